"""What a run leaves for the user to read, run in this process (`--no-ray`): TensorBoard after an
interrupted attempt and its resume holds each step once, with the resumed attempt's values; the process
computes on the CPUs the run asks for, as a Ray worker does, and gives torch's thread count back after."""

from __future__ import annotations

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainers.launch import run_local
from trainers.metrics import read_metrics
from trainers.run_dir import RunDir
from trainers.trainer import TrainerCallback


class _InterruptAfterStep(TrainerCallback):
    """Ctrl-C once `step` is logged: the steps after the last checkpoint are in the logs and will be redone."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, trainer, record):
        if trainer.step == self.step:
            raise KeyboardInterrupt


class _Threads(TrainerCallback):
    def __init__(self):
        self.seen: set[int] = set()

    def after_step(self, trainer, record):
        self.seen.add(torch.get_num_threads())


def _tensorboard_steps(run_dir, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(RunDir(run_dir).tensorboard))  # purges what a later attempt's purge_step drops
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_an_interrupted_and_resumed_run_shows_each_step_once_in_tensorboard(tiny_config):
    cfg = tiny_config(train={"steps": 12, "eval_every": 0, "tensorboard": True}, checkpoint={"every": 5})
    with pytest.raises(KeyboardInterrupt):
        run_local(cfg, callbacks=[_InterruptAfterStep(8)], progress=False)  # steps 6-8 will be redone
    run_local(cfg, progress=False)

    rows = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, 13))
    points = _tensorboard_steps(cfg.out_dir, "train/loss")
    assert [s for s, _ in points] == list(range(1, 13)), "each step once"
    assert [v for _, v in points] == pytest.approx([r["loss"] for r in rows], rel=1e-6)


def test_one_process_computes_on_the_cpus_the_run_asks_for(tiny_config, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    threads = _Threads()
    run_local(tiny_config(train={"steps": 6, "eval_every": 0}, scaling={"cpus_per_worker": 1}),
              callbacks=[threads], progress=False)
    assert threads.seen == {1}
    assert torch.get_num_threads() == before


def test_ctrl_c_of_a_run_without_ray_names_the_step_it_continues_from(corpus_dir, tmp_path, monkeypatch, capsys):
    import yaml

    import trainers.launch
    from raytrain_ext.cli import main
    from tests.conftest import tiny_raw

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump(tiny_raw(corpus_dir, tmp_path / "run", train={"steps": 8, "eval_every": 0},
                                           checkpoint={"every": 5})))
    assert main(["train", str(run), "--no-ray", "--no-progress", "--set", "train.steps=6"]) == 0
    capsys.readouterr()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainers.launch, "run_local", interrupted)
    assert main(["train", str(run), "--no-ray", "--no-progress"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"raytrain: interrupted; run the same command again to continue from step 6 ({tmp_path / 'run'})"]
