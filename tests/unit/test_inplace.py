"""PBT's exploit in place, one process: a trainer that returned at a step boundary (`fit(until=step)`), given a
donor's committed checkpoint (`Trainer.restore`: loaded where it is, as a PBT trial's pin), continues exactly as
a new run resumed from that checkpoint with the same new learning rate would, bit for bit (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from trainers._base import ConfigError
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

STEPS, EVERY, NEW_LR = 20, 10, 3e-3


class _RestoreFromCallback(TrainerCallback):
    def __init__(self, donor):
        self.donor, self.error, self.starts = donor, None, 0

    def on_fit_start(self, trainer):
        self.starts += 1

    def after_checkpoint(self, trainer, path):
        try:
            trainer.restore(self.donor)
        except RuntimeError as e:
            self.error = e


def _rows(run_dir, kind="train"):
    return read_metrics(run_dir / "metrics.jsonl", kind)


def test_a_restore_between_fit_calls_equals_a_resume_from_the_donor(tiny_config):
    sections = dict(train={"steps": STEPS}, checkpoint={"every": EVERY, "mode": "async"})
    donor_cfg = tiny_config("donor", optimizer={"lr": 1e-2}, **sections)
    Trainer(donor_cfg, progress=False).fit()
    donor = donor_cfg.out_dir / "checkpoints" / f"step_{EVERY:08d}"

    ref_cfg = tiny_config(
        "ref",
        optimizer={"lr": NEW_LR},
        train={"steps": STEPS},
        checkpoint={"every": EVERY, "resume": str(donor)},
    )
    ref = Trainer(ref_cfg, progress=False)
    ref.fit()

    cfg = tiny_config("recipient", optimizer={"lr": 1e-4}, **sections)
    live = Trainer(cfg, progress=False)
    first = live.fit(until=EVERY)
    # fit(until) returns at the step with its checkpoint committed: with saves in the background, no step
    # after it was trained (the branch an exploit would abandon is never logged)
    assert first.step == EVERY and first.checkpoint == cfg.out_dir / "checkpoints" / f"step_{EVERY:08d}"
    assert [r["step"] for r in _rows(cfg.out_dir)] == list(range(1, EVERY + 1))
    # the event fields a PBT trial's loop adds for its trackers (search.hooks.GateLoop)
    live.restore(
        donor,
        {"optimizer.lr": NEW_LR},
        event="exploit",
        donor="d",
        values={"optimizer.lr": NEW_LR},
        tags={"t": "1"},
    )
    last = live.fit()
    assert last.step == STEPS and last.stopped is None

    mine, theirs = _rows(cfg.out_dir), _rows(ref_cfg.out_dir)
    assert [r["step"] for r in mine] == list(range(1, STEPS + 1)), "each step once"
    for key in ("loss", "lr", "grad_norm", "samples"):
        assert [r[key] for r in mine[EVERY:]] == [r[key] for r in theirs], key
    assert mine[EVERY]["loss"] == _rows(donor_cfg.out_dir)[EVERY]["loss"], "step 11 on the donor's weights"
    for p, q in zip(live.model.parameters(), ref.model.parameters()):
        assert torch.equal(p, q)
    events = [e["event"] for e in _rows(cfg.out_dir, "event") if e["event"] != "checkpoint"]
    assert events == ["start", "exploit"], "loaded in place: no new start or resume"
    (exploit,) = [e for e in _rows(cfg.out_dir, "event") if e["event"] == "exploit"]
    assert (
        exploit["donor"] == "d"
        and exploit["values"] == {"optimizer.lr": NEW_LR}
        and exploit["tags"] == {"t": "1"}
    )
    saves = [e["step"] for e in _rows(cfg.out_dir, "event") if e["event"] == "checkpoint"]
    assert saves == [EVERY, STEPS], saves
    evals = [r["step"] for r in _rows(cfg.out_dir, "eval")]
    assert evals == sorted(set(evals)), evals
    assert _rows(cfg.out_dir, "eval")[-1]["val_loss"] == _rows(ref_cfg.out_dir, "eval")[-1]["val_loss"]
    with pytest.raises(RuntimeError, match="has ended"):
        live.fit()


def test_fit_until_saves_at_its_step_and_a_callback_cannot_move_the_step(tiny_config):
    """fit(until) commits a checkpoint at its step even off the schedule; a callback's restore is refused,
    so the step only ever moves by training."""
    donor_cfg = tiny_config("donor", train={"steps": 8}, checkpoint={"every": 2})
    Trainer(donor_cfg, progress=False).fit()
    cfg = tiny_config("run", train={"steps": 8}, checkpoint={"every": 0, "final": False})
    hook = _RestoreFromCallback(donor_cfg.out_dir / "checkpoints" / "step_00000002")
    trainer = Trainer(cfg, callbacks=[hook], progress=False)
    result = trainer.fit(until=3)
    assert result.step == 3 and result.checkpoint.name == "step_00000003"
    assert isinstance(hook.error, RuntimeError) and "between fit() calls" in str(hook.error)
    assert trainer.step == 3, "the refused restore moved nothing"
    assert trainer.fit().step == 8
    assert hook.starts == 1, "on_fit_start once per run, not per fit call"
    assert [r["step"] for r in _rows(cfg.out_dir)] == list(range(1, 9))


def test_set_hparams_is_the_one_way_hyperparameters_change_and_refuses_the_rest(tiny_config):
    trainer = Trainer(tiny_config("live", train={"steps": 4}, schedule={"name": "constant"}), progress=False)
    trainer.set_hparams({"optimizer.lr": 0.25, "schedule.name": "warmup_linear", "schedule.warmup_steps": 2})
    assert trainer.cfg.optimizer.lr == 0.25 and trainer.cfg.schedule.name == "warmup_linear"
    assert {g["initial_lr"] for g in trainer.engine.param_groups} == {0.25}, "written into the optimizer"
    assert trainer.lr_schedule.apply(0) == 0.25 / 2, "and the schedule: warmup step 1 of 2"
    with pytest.raises(ConfigError, match=r"^model\.dim, train\.steps cannot change in a running trainer"):
        trainer.set_hparams({"train.steps": 8, "model.dim": 64, "optimizer.lr": 0.5})
    assert trainer.cfg.optimizer.lr == 0.25 and trainer.cfg.train.steps == 4, (
        "a refused change changes nothing"
    )


def test_a_restore_to_an_earlier_step_keeps_the_new_branchs_commits_as_the_newest(tiny_config):
    """A PBT rollback (a donor behind the recipient): the run commits lower steps after higher ones. Retention
    (keep 2) keeps the branch's own commit, and the newest a restart resumes from is it, not the abandoned
    branch's higher step."""
    from trainers.checkpoint_files import committed_checkpoints
    from trainers.resume import resume_candidate

    donor_cfg = tiny_config("donor", train={"steps": 60}, checkpoint={"every": EVERY, "mode": "sync", "keep": 10})
    Trainer(donor_cfg, progress=False).fit()
    cfg = tiny_config("recipient", train={"steps": 60}, checkpoint={"every": EVERY, "mode": "sync", "keep": 2})
    live = Trainer(cfg, progress=False)
    live.fit(until=50)
    live.restore(donor_cfg.out_dir / "checkpoints" / f"step_{EVERY:08d}")
    ours = live.fit(until=20).checkpoint
    assert ours.is_dir(), "the branch's commit survives retention"
    assert committed_checkpoints(cfg.out_dir / "checkpoints") == [ours, cfg.out_dir / "checkpoints" / "step_00000050"]
    assert resume_candidate("auto", cfg.out_dir) == ours and live.checkpointer.latest() == ours
    assert live.fit(until=30).checkpoint.is_dir()
    assert [p.name for p in committed_checkpoints(cfg.out_dir / "checkpoints")] == ["step_00000030", "step_00000020"]
