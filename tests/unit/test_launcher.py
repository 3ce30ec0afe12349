"""The Ray launcher's checks that run before any worker starts, and where a restarted attempt resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray.train import Checkpoint

from raytrain_ext.cli import main
from raytrain_ext.launcher import build_trainer, check_run
from raytrain_ext.worker import POINTER, load_callback, pointed_to, resume_point, write_pointer
from tests.conftest import tiny_raw
from trainers.checkpoint import Checkpointer
from trainers.config import ConfigError, parse_config


def test_scaling_sizes_and_errors(corpus_dir, tmp_path):
    cfg = parse_config(tiny_raw(corpus_dir, tmp_path, scaling={"min_workers": 1, "max_workers": 4}))
    assert cfg.scaling.elastic and list(cfg.scaling.sizes) == [1, 2, 3, 4]
    assert list(parse_config(tiny_raw(corpus_dir, tmp_path)).scaling.sizes) == [1]
    for bad, key in [({"min_workers": 3, "max_workers": 2}, "scaling.min_workers=3"),
                     ({"num_workers": 2, "max_workers": 2}, "num_workers and min_workers"),
                     ({"min_workers": 2}, "needs both")]:
        with pytest.raises(ConfigError, match=key) as e:
            parse_config(tiny_raw(corpus_dir, tmp_path, scaling=bad))
        assert "\n" not in str(e.value) and "fix:" in str(e.value)


def test_every_elastic_size_must_keep_the_global_batch(corpus_dir, tmp_path):
    # global 8 = micro 4 x accumulation x dp: fine at 1 and 2 workers, impossible at 3.
    cfg = parse_config(tiny_raw(corpus_dir, tmp_path, parallel={"engine": "ddp"},
                                scaling={"min_workers": 1, "max_workers": 3}))
    with pytest.raises(ConfigError, match=r"at world size 3 \(scaling allows 1\.\.3\): train.global_batch_size=8"):
        check_run(cfg)
    check_run(cfg.model_copy(update={"scaling": cfg.scaling.model_copy(update={"max_workers": 2})}))


def test_every_elastic_size_must_fit_the_expert_degree(corpus_dir, tmp_path):
    # ep=2 needs an even data-parallel size: 2 and 4 workers are fine, 3 is refused before any worker starts
    # (a worker would refuse it only after Ray had placed the group).
    moe = {"moe": {"num_experts": 4, "top_k": 2}}
    raw = tiny_raw(corpus_dir, tmp_path, model=moe, parallel={"engine": "fsdp", "ep": 2},
                   train={"global_batch_size": 24, "micro_batch_size": 2},
                   scaling={"min_workers": 2, "max_workers": 4})
    with pytest.raises(ConfigError, match=r"at world size 3 \(scaling allows 2\.\.4\): parallel.ep=2 does not divide") as e:
        check_run(parse_config(raw))
    assert "\n" not in str(e.value) and "fix:" in str(e.value)
    raw["scaling"] = {"num_workers": 4}
    check_run(parse_config(raw))


def test_unsharded_engine_refused_for_several_workers(corpus_dir, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    import yaml

    path.write_text(yaml.safe_dump(tiny_raw(corpus_dir, tmp_path / "r", scaling={"num_workers": 2})))
    assert main(["train", str(path), "--no-progress"]) == 2  # before Ray starts
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "parallel.engine=none at world size 2; fix:" in err


def test_trainer_built_from_yaml(corpus_dir, tmp_path):
    cfg = parse_config(tiny_raw(corpus_dir, tmp_path / "runs" / "x", parallel={"engine": "fsdp"},
                                scaling={"min_workers": 1, "max_workers": 2, "max_failures": 5}))
    trainer = build_trainer(cfg, ray_run="20261127-041500-abcdef")
    assert trainer.scaling_config.num_workers == (1, 2)
    assert trainer.run_config.failure_config.max_failures == 5
    # the invocation's own Ray run inside the run dir; our checkpoints stay the run dir's
    assert trainer.run_config.storage_path == str((tmp_path / "runs" / "x" / "ray").resolve())
    assert trainer.run_config.name == "20261127-041500-abcdef"
    assert trainer.run_config.checkpoint_config.num_to_keep == 1, "Ray keeps a pointer to the newest only"


def _commit(root, step):
    path = root / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "COMMITTED").write_text("")
    return path


def test_resume_point(corpus_dir, tmp_path):
    cfg = parse_config(tiny_raw(corpus_dir, tmp_path / "run"))
    assert resume_point(cfg, None) == "auto"  # the run YAML decides when Ray hands nothing over
    none = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"resume": "none"})})
    assert resume_point(none, None) == "none"
    s10, s20 = _commit(cfg.out_dir, 10), _commit(cfg.out_dir, 20)
    assert Checkpointer(cfg.out_dir / "checkpoints", 3).candidates() == [s20, s10]
    # Ray registered step 10 only (the worker died before step 20's report reached the controller): the
    # Trainer restores our newest committed one (auto), whichever Ray names, even when resume was none.
    assert resume_point(cfg, _pointer(tmp_path, s10)) == "auto"
    assert resume_point(none, _pointer(tmp_path, s10)) == "auto"
    # A checkpoint from outside this run (a Tune exploit's donor) wins even when older.
    donor = _commit(tmp_path / "donor", 5)
    assert resume_point(cfg, _pointer(tmp_path, donor)) == str(donor.resolve())


def _pointer(tmp_path, checkpoint):
    """What Ray holds for one of our checkpoints (`ReportToRay`): a folder with a pointer to it."""
    folder = tmp_path / "ray" / f"checkpoint_{len(list(tmp_path.glob('ray/*')))}"
    folder.mkdir(parents=True)
    write_pointer(folder, checkpoint)
    return Checkpoint.from_directory(str(folder))


def test_a_pointer_names_the_committed_checkpoint_and_its_step(tmp_path):
    s7 = _commit(tmp_path / "run", 7)
    held = _pointer(tmp_path, s7)
    assert pointed_to(held) == s7.resolve()
    assert json.loads((Path(held.path) / POINTER).read_text())["step"] == 7


def test_callback_specs():
    cb = load_callback("tests.ray.hooks:KillMeAtStep(step=3, rank=1)")
    assert (cb.step, cb.rank) == (3, 1)
    with pytest.raises(ConfigError, match="is not module:Name"):
        load_callback("tests.ray.hooks.KillMeAtStep")


def test_a_resume_past_a_damaged_checkpoint_names_it_on_the_console():
    from raytrain_ext.launcher import event_line

    resume = {"kind": "event", "event": "resume", "step": 8, "world_size": 2}
    assert event_line(resume) == "resumed from step 8 on 2 workers"
    skipped = [{"checkpoint": "/runs/r/checkpoints/step_00000012/", "reason": "model/0.distcp: checksum mismatch"}]
    assert event_line({**resume, "skipped": skipped}) == (
        "resumed from step 8 on 2 workers; skipped damaged checkpoint step_00000012 (model/0.distcp: checksum mismatch)"
    )
    assert event_line({"kind": "event", "event": "checkpoint", "step": 8}) is None


def test_a_lost_peers_collective_error_is_not_a_failure_of_the_rank_itself():
    """A survivor's gloo error when another rank dies is retried (Ray restarts the group), also before the
    first checkpoint; a rank's own error before it is not (a restart would repeat the same steps)."""
    from raytrain_ext.worker import lost_peer

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:42370. This is typically caused by a remote worker crashing."
    )
    assert lost_peer(gloo)
    # the other worker of a replica group whose first worker (its torchft manager's server) was killed
    # (tests/ray/test_fault_tolerance.py's FSDP groups: this error failed the run as "early" once in 4 runs)
    torchft = RuntimeError('status: Unknown, message: "transport error", details: [], metadata: MetadataMap { headers: {} }')
    assert lost_peer(torchft)
    assert not lost_peer(RuntimeError("injected failure at step 3"))
    assert not lost_peer(ValueError("shape mismatch"))


def test_a_failure_is_recorded_by_its_kind_and_raised_again_as_itself(tmp_path):
    import json

    from raytrain_ext.launcher import RunFailedError, _as_error, _read_failed
    from raytrain_ext.worker import _write_failed
    from trainers._base import NonFiniteLossError
    from trainers.checkpoint import CheckpointError
    from trainers.run_dir import FAILED

    class ConfigErrorOfAPlugin(ConfigError):  # a subclass is still a config failure: no class names involved
        pass

    cases = [
        (ConfigErrorOfAPlugin("data.path: missing; fix: ..."), "config", ConfigError),
        (NonFiniteLossError("loss is nan at step 3"), "non_finite_loss", NonFiniteLossError),
        (CheckpointError("step_00000004: damaged"), "checkpoint", CheckpointError),
        (ZeroDivisionError("division by zero"), "early", RunFailedError),
    ]
    for error, kind, raised in cases:
        _write_failed(tmp_path, error)
        record = json.loads((tmp_path / FAILED).read_text())
        assert record["kind"] == kind
        again = _as_error(_read_failed(tmp_path))
        assert type(again) is raised and str(error) in str(again)
    assert "ZeroDivisionError: division by zero" in str(again) and "before the first checkpoint" in str(again)


def test_the_console_tells_this_invocations_events_not_those_of_earlier_ones(tmp_path, capsys):
    """A run resumed again: its metrics.jsonl already holds the last invocation's resume; the watcher (made
    before the workers start) tells only the resume and resize that this invocation writes, each once,
    also after a restart rewrites the log."""
    from raytrain_ext.launcher import _ProgressWatcher

    log = tmp_path / "metrics.jsonl"

    def event(name, step, t, **extra):
        return json.dumps({"kind": "event", "event": name, "step": step, "time": t, **extra}) + "\n"

    earlier = event("resume", 6, 100.0, world_size=2)
    log.write_text(event("start", 0, 50.0) + earlier)
    watcher = _ProgressWatcher(log, total=30, name="t", bar=False)
    now = event("resume", 12, 200.0, world_size=2) + event("resize", 12, 201.0, old_world_size=2,
                                                            new_world_size=1, accumulation=4)
    log.write_text(event("start", 0, 50.0) + earlier + now)  # a rewrite (a restore rewinds the log) ...
    with log.open("a") as f:
        f.write(json.dumps({"kind": "train", "step": 13, "loss": 2.0, "tokens_per_s": 10.0, "world_size": 1}) + "\n")
    watcher.start()
    watcher.stop()  # its last pass reads what is there
    err = capsys.readouterr().err
    assert "resumed from step 6" not in err
    assert err.count("resumed from step 12 on 2 workers") == 1 and err.count("resized 2 -> 1 workers") == 1
