"""PBT's exploit in place, one process: a donor's checkpoint installed into a running trainer's checkpoint
folder and loaded into it (`Trainer.load_in_place`) continues exactly as a new run resumed from that
checkpoint with the same new learning rate would, bit for bit (fp32, CPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from trainers._base import ConfigError
from trainers.checkpoint_files import COMMITTED, checkpoint_step, install_checkpoint
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

STEPS, EVERY, NEW_LR = 20, 10, 3e-3


class _ExploitAt(TrainerCallback):
    """After the checkpoint of `step`: install `donor` as this run's newest and load it with NEW_LR."""

    def __init__(self, step, donor):
        self.step, self.donor, self.done = step, donor, False

    def after_checkpoint(self, trainer, path):
        # An async save commits a few steps after its step: those steps are the branch the exploit abandons.
        if checkpoint_step(path) == self.step and not self.done:
            self.done = True
            installed = install_checkpoint(trainer.run_dir / "checkpoints", self.donor)
            # the event fields a PBT trial's hook adds for its trackers (search.hooks.WaitAtGate)
            trainer.load_in_place(
                installed, {"optimizer.lr": NEW_LR}, donor="d", values={"optimizer.lr": NEW_LR}, tags={"t": "1"}
            )


def _rows(run_dir, kind="train"):
    return read_metrics(run_dir / "metrics.jsonl", kind)


def test_load_in_place_equals_a_resume_from_the_donor(tiny_config):
    sections = dict(train={"steps": STEPS}, checkpoint={"every": EVERY})
    donor_cfg = tiny_config("donor", optimizer={"lr": 1e-2}, **sections)
    Trainer(donor_cfg, progress=False).fit()
    donor = donor_cfg.out_dir / "checkpoints" / f"step_{EVERY:08d}"

    ref_cfg = tiny_config(
        "ref", optimizer={"lr": NEW_LR}, train={"steps": STEPS}, checkpoint={"every": EVERY, "resume": str(donor)}
    )
    ref = Trainer(ref_cfg, progress=False)
    ref.fit()

    cfg = tiny_config("recipient", optimizer={"lr": 1e-4}, **sections)
    live = Trainer(cfg, callbacks=[_ExploitAt(EVERY, donor)], progress=False)
    live.fit()

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
    assert exploit["donor"] == "d" and exploit["values"] == {"optimizer.lr": NEW_LR} and exploit["tags"] == {"t": "1"}
    # The exploit was loaded when the step-10 save committed, a step or more later (async): the run goes on
    # from the donor's step 10 without saving, evaluating or reporting step 10 again (a second report of 10
    # would meet the gate's stored answer and apply the same exploit twice).
    saves = [e["step"] for e in _rows(cfg.out_dir, "event") if e["event"] == "checkpoint"]
    assert saves == [EVERY, STEPS], saves
    evals = [r["step"] for r in _rows(cfg.out_dir, "eval")]
    assert evals == sorted(set(evals)), evals
    assert _rows(cfg.out_dir, "eval")[-1]["val_loss"] == _rows(ref_cfg.out_dir, "eval")[-1]["val_loss"]


def _fake_checkpoint(root, step, content):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": step}))
    (path / "shard.distcp").write_text(content)
    (path / COMMITTED).write_text(json.dumps({"step": step}))
    return path


def test_install_makes_the_donor_newest_and_removes_own_checkpoints_from_its_step_on(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    for step in (5, 10, 20):
        _fake_checkpoint(root, step, f"own {step}")
    donor = _fake_checkpoint(tmp_path / "donor", 10, "donor 10")

    installed = install_checkpoint(root, donor)

    assert installed == root / "step_00000010"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005", "step_00000010"], "no staging left"
    assert (installed / "shard.distcp").read_text() == "donor 10"
    assert os.stat(installed / "shard.distcp").st_ino == os.stat(donor / "shard.distcp").st_ino, "linked"


def test_set_hparams_is_the_one_way_hyperparameters_change_and_refuses_the_rest(tiny_config):
    trainer = Trainer(tiny_config("live", train={"steps": 4}, schedule={"name": "constant"}), progress=False)
    trainer.set_hparams({"optimizer.lr": 0.25, "schedule.name": "warmup_linear", "schedule.warmup_steps": 2})
    assert trainer.cfg.optimizer.lr == 0.25 and trainer.cfg.schedule.name == "warmup_linear"
    assert {g["initial_lr"] for g in trainer.engine.param_groups} == {0.25}, "written into the optimizer"
    assert trainer.lr_schedule.apply(0) == 0.25 / 2, "and the schedule: warmup step 1 of 2"
    with pytest.raises(ConfigError, match=r"^model\.dim, train\.steps cannot change in a running trainer"):
        trainer.set_hparams({"train.steps": 8, "model.dim": 64, "optimizer.lr": 0.5})
    assert trainer.cfg.optimizer.lr == 0.25 and trainer.cfg.train.steps == 4, "a refused change changes nothing"
