"""Exact resume: 40 steps straight == 20 steps, a crash, a resume and 20 more (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from trainers.checkpoint_files import checkpoint_step
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback


class _CrashAfter(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def after_checkpoint(self, trainer, path):
        if checkpoint_step(path) == self.step:  # committed; an async save commits a few steps later
            raise KeyboardInterrupt  # what a killed process looks like from here: no clean shutdown


def _train_rows(run_dir):
    return read_metrics(run_dir / "metrics.jsonl", "train")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_resume_equals_uninterrupted(tiny_config, moe):
    model = {"moe": {"num_experts": 4, "top_k": 2}} if moe else {}
    straight_cfg = tiny_config("straight", model=model)
    straight = Trainer(straight_cfg, progress=False)
    straight.fit()

    cfg = tiny_config("resumed", model=model, checkpoint={"every": 20})
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg, callbacks=[_CrashAfter(20)], progress=False).fit()
    before = [r["step"] for r in _train_rows(cfg.out_dir)]
    assert before == list(range(1, len(before) + 1)) and len(before) >= 20  # async: steps past the save too
    resumed = Trainer(cfg, progress=False)
    assert resumed.step == 20
    resumed.fit()

    a, b = _train_rows(straight_cfg.out_dir), _train_rows(cfg.out_dir)
    assert [r["step"] for r in b] == list(range(1, 41)), "each step exactly once in metrics.jsonl"
    for key in ("loss", "lr", "grad_norm", "samples"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    for p, q in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    evals = [r["val_loss"] for r in read_metrics(cfg.out_dir / "metrics.jsonl", "eval")]
    assert evals == [r["val_loss"] for r in read_metrics(straight_cfg.out_dir / "metrics.jsonl", "eval")]
    events = [r for r in read_metrics(cfg.out_dir / "metrics.jsonl", "event") if r["event"] == "resume"]
    assert len(events) == 1 and events[0]["step"] == 20


def test_a_resume_does_not_initialise_weights_it_then_overwrites(tiny_config, monkeypatch):
    """The restore writes every weight: a resume builds the model uninitialised (meta, then zeroed storage),
    not a random init first (~6 s of a 1.1B resume's build, bench/results/resume_profile_gpu.txt)."""
    from trainers.models import Transformer

    cfg = tiny_config("run", train={"steps": 10}, checkpoint={"every": 10})
    first = Trainer(cfg, progress=False)
    first.fit()
    longer = cfg.model_copy(deep=True)
    longer.train.steps = 12

    def refuse(self):
        raise AssertionError("init_weights ran on a resume")

    monkeypatch.setattr(Transformer, "init_weights", refuse)
    resumed = Trainer(longer, progress=False)
    assert resumed.step == 10
    for p, q in zip(first.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)
    resumed.fit()
    assert resumed.step == 12 and all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_changed_learning_rate_takes_effect_on_resume(tiny_config):
    cfg = tiny_config(
        "a", schedule={"name": "constant", "warmup_steps": 0}, train={"steps": 10}, checkpoint={"every": 10}
    )
    Trainer(cfg, progress=False).fit()
    longer = cfg.model_copy(deep=True)
    longer.train.steps = 12
    longer.optimizer.lr = 1e-4
    resumed = Trainer(longer, progress=False)
    assert resumed.step == 10
    resumed.fit()
    rows = _train_rows(cfg.out_dir)
    assert [r["lr"] for r in rows[-2:]] == [1e-4, 1e-4]
    assert all(r["lr"] == 3e-3 for r in rows[:10])


def test_gradient_accumulation_matches_one_big_batch(tiny_config):
    one = Trainer(tiny_config("one", train={"steps": 8, "micro_batch_size": 8}), progress=False)
    one.fit()
    four = Trainer(tiny_config("four", train={"steps": 8, "micro_batch_size": 2}), progress=False)
    four.fit()
    la, lb = (r["loss"] for r in _train_rows(one.run_dir)), (r["loss"] for r in _train_rows(four.run_dir))
    for x, y in zip(la, lb):
        assert x == pytest.approx(y, rel=1e-5)


@pytest.mark.parametrize("every", [0, 4])
def test_final_false_saves_only_every_n_steps(tiny_config, every):
    """`checkpoint.final: false`: no save at the end (with every 0, none at all: a benchmark's run)."""
    cfg = tiny_config("nofinal", train={"steps": 6}, checkpoint={"every": every, "final": False})
    result = Trainer(cfg, progress=False).fit()
    saved = [r["step"] for r in read_metrics(cfg.out_dir / "metrics.jsonl", "event")
             if r["event"] == "checkpoint"]
    assert saved == ([4] if every else [])
    assert (result.checkpoint is None) == (not every)
