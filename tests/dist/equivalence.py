"""Shared by the multi-process equivalence tests: train runs on every rank collecting each step's whole
gradients by FQN, merge them over ranks, and compare runs and gradients with a single-process reference."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

RTOL = 1e-5  # relative, fp32: only the order of sums differs


class Grads(TrainerCallback):
    """Each step's gradients (after clipping, before the next step zeroes them), whole tensors by FQN."""

    def __init__(self):
        self.per_step: dict[int, dict[str, torch.Tensor]] = {}

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        grads = {}
        for name, p in trainer.model.named_parameters():  # the same order on ranks sharing a mesh
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[name.replace("._checkpoint_wrapped_module", "")] = g.detach().clone()
        self.per_step[trainer.step] = grads


def train(raw: dict) -> dict[int, dict[str, torch.Tensor]]:
    grads = Grads()
    Trainer(parse_config(raw), callbacks=[grads], progress=False).fit()
    return grads.per_step


def train_each(rank: int, world: int, raws: dict[str, dict]) -> dict[str, dict]:
    """On every rank of a `run_ranks` group: each run in turn; returns its gradients per step."""
    return {name: train(raw) for name, raw in raws.items()}


def merged(per_rank: list[dict[str, dict]]) -> dict[str, dict]:
    """Each run's gradients per step, the union over ranks (pipeline stages hold different names)."""
    out: dict[str, dict] = {}
    for result in per_rank:
        for name, steps in result.items():
            for step, grads in steps.items():
                out.setdefault(name, {}).setdefault(step, {}).update(grads)
    return out


def rows(run_dir: Path, kind: str = "train") -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl", kind)


def values(run_dir: Path, key: str, kind: str = "train") -> list[float]:
    return [r[key] for r in rows(run_dir, kind)]


def assert_same_run(run_dir: Path, ref_dir: Path, total: int, steps: range | None = None) -> None:
    """Each of `total` steps logged once; losses, grad norms, MoE aux losses (at `steps`) and validation
    losses equal the reference's within RTOL."""
    got = {r["step"]: r for r in rows(run_dir)}
    ref = {r["step"]: r for r in rows(ref_dir)}
    steps = steps or range(1, total + 1)
    assert sorted(got) == list(range(1, total + 1)), "each step once, logged by rank 0 alone"
    keys = ["loss", "grad_norm", "samples"] + (["moe_aux_loss", "moe_z_loss"] if "moe_aux_loss" in ref[1] else [])
    for step in steps:
        for key in keys:
            assert got[step][key] == pytest.approx(ref[step][key], rel=RTOL), (step, key)
    assert values(run_dir, "val_loss", "eval") == pytest.approx(values(ref_dir, "val_loss", "eval"), rel=RTOL)


def assert_same_grads(got: dict[int, dict], ref: dict[int, dict]) -> None:
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert sorted(got[step]) == sorted(ref[step]), "every parameter has a gradient, under its own name"
        for name, r in ref[step].items():
            error = float((got[step][name] - r).norm() / r.norm().clamp_min(1e-30))
            assert error <= RTOL, (step, name, error)


def copy_at_step(src: Path, dst: Path, step: int) -> None:
    """A copy of run `src` holding only its checkpoint of `step` (the resume drops later metrics)."""
    shutil.copytree(src, dst)
    for later in (dst / "checkpoints").glob("step_*"):
        if later.name != f"step_{step:08d}":
            shutil.rmtree(later)
