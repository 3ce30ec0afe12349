"""Checkpoints: DCP round trip, atomic commit, interrupted saves ignored, retention."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainers.checkpoint import Checkpointer, ModelOptimizerState, is_complete


def _model_and_opt(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_round_trip_restores_model_optimizer_state_and_rng(tmp_path):
    model, opt = _model_and_opt(0)
    ckpt = Checkpointer(tmp_path, keep=2)
    rng = torch.get_rng_state()
    path = ckpt.save(
        7, {"app": ModelOptimizerState(model, opt)}, {"step": 7, "samples": 56}, rng={"torch": rng}
    )
    assert path.name == "step_00000007" and is_complete(path) and ckpt.latest() == path

    other, other_opt = _model_and_opt(1)
    assert not _same(model, other)
    state, loaded_rng = ckpt.load(path, {"app": ModelOptimizerState(other, other_opt)})
    assert state == {"step": 7, "samples": 56}
    assert torch.equal(loaded_rng["torch"], rng)
    assert _same(model, other)
    for p, q in zip(opt.state.values(), other_opt.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])


def test_interrupted_save_leaves_previous_checkpoint_and_is_ignored(tmp_path):
    model, opt = _model_and_opt(0)
    ckpt = Checkpointer(tmp_path, keep=3)
    good = ckpt.save(10, {"app": ModelOptimizerState(model, opt)}, {"step": 10})

    class Crash(Exception):
        pass

    def crash(_partial):
        raise Crash

    with pytest.raises(Crash):
        ckpt.save(20, {"app": ModelOptimizerState(model, opt)}, {"step": 20}, before_commit=crash)
    assert (tmp_path / "step_00000020.partial").is_dir()
    assert not (tmp_path / "step_00000020").exists()
    assert ckpt.latest() == good
    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "step_00000020.partial", {"app": ModelOptimizerState(model, opt)})
    # The next successful save clears the leftover.
    ckpt.save(30, {"app": ModelOptimizerState(model, opt)}, {"step": 30})
    assert not (tmp_path / "step_00000020.partial").exists()
    assert ckpt.load(good, {"app": ModelOptimizerState(model, opt)})[0]["step"] == 10


def test_retention_keeps_newest(tmp_path):
    model, opt = _model_and_opt(0)
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        ckpt.save(step, {"app": ModelOptimizerState(model, opt)}, {"step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000004"]
