"""Shared by the multi-process equivalence tests: train runs on every rank collecting each step's whole
gradients and the parameters each step started from, by FQN; merge them over ranks; compare runs and
gradients with a single process.

Gradients are compared where both were computed from the same parameters. Two fp32 runs that sum in other
orders end step 1 with parameters a few roundings apart, and AdamW magnifies that where a gradient is
within rounding of zero (its step lr * m / (sqrt(v) + eps) moves up to lr/eps = 3e5 times a change in g);
by step 3 an 8-block MoE's q/k gradients differed by up to 1.04e-5 between pp1-dp4-ep2 and one process
(issue 40) while each step's own sums agreed to 3e-7. So the single process recomputes every step at the run's own
parameters (`trace(..., follow=...)`), and `assert_as_accurate` bounds what is left, the rounding of the
same arithmetic in another order, by the single process's own rounding error against float64.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.dist.harness import rank_threads
from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.trainer import Trainer, TrainerCallback

# Run-level numbers (losses, grad norms, MoE aux losses, validation losses) of two runs, relative: each is a
# mean over a step's 256 tokens, which the few weights AdamW moved apart (above) barely change; measured at
# most 2.3e-7 over the pipeline layouts of tests/dist/test_pipeline.py.
RTOL = 1e-5
U = 2.0**-24  # fp32 unit roundoff

Tensors = dict[str, torch.Tensor]


def _whole(named: Any) -> Tensors:
    """(FQN, tensor) pairs as whole tensors (a DTensor gathered: every rank of its mesh calls this in the same
    order), under the FQNs of a model without activation-checkpoint wrappers."""
    out = {}
    for name, t in named:
        t = t.full_tensor() if isinstance(t, DTensor) else t
        out[name.replace("._checkpoint_wrapped_module", "")] = t.detach().clone()
    return out


class Grads(TrainerCallback):
    """Each step's gradients (after clipping, before the next step zeroes them) in `per_step`, and in `start`
    the parameters each step computed them at. With `follow` (another run's `start`) the parameters are set
    to that run's before each step: the gradients are this run's arithmetic at the other run's parameters."""

    def __init__(self, follow: dict[int, Tensors] | None = None):
        self.per_step: dict[int, Tensors] = {}
        self.start: dict[int, Tensors] = {}
        self.follow = follow

    def on_fit_start(self, trainer: Trainer) -> None:
        self._before_step(trainer)

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        params = trainer.model.named_parameters()  # the same order on ranks sharing a mesh
        self.per_step[trainer.step] = _whole((n, p.grad) for n, p in params if p.grad is not None)
        if trainer.step < trainer.cfg.train.steps:
            self._before_step(trainer)

    @torch.no_grad()
    def _before_step(self, trainer: Trainer) -> None:
        step = trainer.step + 1
        if self.follow is not None:
            for name, p in trainer.model.named_parameters():
                p.copy_(self.follow[step][name])
        self.start[step] = _whole(trainer.model.named_parameters())


def trace(raw: dict, follow: dict[int, Tensors] | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """Train `raw` here; returns {"grads": gradients per step, "start": parameters per step} (`Grads`).
    `dtype`: the default dtype the model is built in. In the test's own process (a single-process reference)
    torch computes with a rank's thread count (`rank_threads`)."""
    grads = Grads(follow)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with rank_threads():
            Trainer(parse_config(raw), callbacks=[grads], progress=False).fit()
    finally:
        torch.set_default_dtype(previous)
    return {"grads": grads.per_step, "start": grads.start}


def train(raw: dict) -> dict[int, Tensors]:
    return trace(raw)["grads"]


def train_each(rank: int, world: int, raws: dict[str, dict]) -> dict[str, dict]:
    """On every rank of a `run_ranks` group: each run in turn; returns its gradients per step."""
    return {name: train(raw) for name, raw in raws.items()}


def trace_each(rank: int, world: int, raws: dict[str, dict]) -> dict[str, dict]:
    """As `train_each`, returning each run's `trace`."""
    return {name: trace(raw) for name, raw in raws.items()}


def merged(per_rank: list[dict]) -> dict:
    """The ranks' results as one: nested dicts united level by level down to the tensors (pipeline stages
    hold different FQNs)."""
    out: dict = {}
    for result in per_rank:
        _merge(out, result)
    return out


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict):
            _merge(into.setdefault(key, {}), value)
        else:
            into[key] = value


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


def assert_same_grads(got: dict[int, Tensors], ref: dict[int, Tensors]) -> None:
    """Two runs of the same layout that differ in one kernel (tests/dist/test_moe_impls.py), step by step
    within RTOL: their parameters part only where the two kernels round differently."""
    assert sorted(got) == sorted(ref)
    for step in ref:
        assert sorted(got[step]) == sorted(ref[step]), "every parameter has a gradient, under its own name"
        for name, r in ref[step].items():
            error = float((got[step][name] - r).norm() / r.norm().clamp_min(1e-30))
            assert error <= RTOL, (step, name, error)


def one_process_at(got: dict, one: dict) -> tuple[dict[int, Tensors], dict[int, Tensors]]:
    """One process's gradients at the parameters each step of `got` (a `trace`) started from: in fp32 and in
    float64. `one`: the same run's raw config for one process (no `parallel`)."""
    fp32 = trace(_aside(one, "fp32"), follow=got["start"])["grads"]
    fp64 = trace(_aside(one, "fp64", float64=True), follow=got["start"], dtype=torch.float64)["grads"]
    return fp32, fp64


def _aside(raw: dict, name: str, float64: bool = False) -> dict:
    """`raw` in a folder of its own, saving no checkpoint; float64: the MoE experts by the loop (torch's
    grouped matmul has no float64 kernel; the loop is the same arithmetic, tests/dist/test_moe_impls.py)."""
    out = {**raw, "run_dir": str(Path(raw["run_dir"]) / name), "checkpoint": {"every": 0, "final": False}}
    if float64 and raw["model"].get("moe"):
        out["model"] = {**raw["model"], "moe": {**raw["model"]["moe"], "impl": "loop"}}
    return out


def assert_as_accurate(got: dict[int, Tensors], one: dict[int, Tensors], exact: dict[int, Tensors]) -> None:
    """Every gradient in `got` is about as close to `exact` as one process's fp32 gradient `one` is, all three
    computed at the same parameters from the same batch (`one_process_at`). Per tensor, relative to its exact
    norm: err(got) <= 8 err(one) + 8u (u = 2^-24).

    - err(one) is what fp32 arithmetic gets wrong in this tensor, measured: 1-5u for most, up to ~80u in
      the q/k projections by step 3 (their gradients come out of the softmax backward's difference
      dS = P (dP - rowsum(P dP)), much smaller than the terms it subtracts). The layout does the same
      operations in other orders (partial sums over ranks and stages; matmuls over other row counts, and MKL
      rounds a product of 1-3 rows differently) and a few more (tensor parallelism's halves, added after an
      all-reduce): its rounding error is of the same size; 8x allows for that (measured <= 2.7x over the
      pipeline, tensor-parallel and expert layouts, every step and tensor).
    - 8u where one process happens to be nearly exact: the layout still adds the step's 4 micro-batch
      gradients in another order, which moves their sum by <= 2 gamma_3 = 6u of its magnitude, and scales
      by a clip coefficient whose norm was summed in another grouping (~2u).
    `exact` is float64 but for the loss's and the router's softmax, which the model computes in fp32.
    """
    assert sorted(got) == sorted(one) == sorted(exact)
    for step, grads in exact.items():
        assert sorted(got[step]) == sorted(grads), "every parameter has a gradient, under its own name"
        for name, x in grads.items():
            err, own = _error(got[step][name], x), _error(one[step][name], x)
            assert err <= 8 * own + 8 * U, (step, name, f"{err / U:.1f}u", f"one process {own / U:.1f}u")


def _error(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a.double() - exact).norm() / exact.norm().clamp_min(1e-300))


def copy_at_step(src: Path, dst: Path, step: int) -> None:
    """A copy of run `src` holding only its checkpoint of `step` (the resume drops later metrics)."""
    shutil.copytree(src, dst)
    for later in (dst / "checkpoints").glob("step_*"):
        if later.name != f"step_{step:08d}":
            shutil.rmtree(later)
