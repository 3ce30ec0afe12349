"""Expert parallelism on 4 gloo processes: experts sharded over ep ranks, tokens moved by all-to-all.

1. Equivalence: dropless top-2 and capacity-dropping top-1 runs match one process (losses, aux and
   z-losses within 1e-5 relative; every gradient as accurate as one process's at the same parameters,
   `assert_as_accurate` in tests/dist/equivalence.py): routing and dropping happen on each rank's own
   micro-batch exactly as on one device, and expert gradients are summed over the ranks that hold the
   same experts and divided by the data-parallel size (never averaged over ranks that do not hold them).
2. Metrics on a fixed routing (the router's logits overridden by position): tokens per expert, the
   dropped fraction and the load imbalance, summed over micro-batches, data-parallel ranks and pipeline
   stages, equal values counted by hand from the routing rule.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.dist.equivalence import (
    assert_as_accurate,
    assert_same_run,
    merged,
    one_process_at,
    rows,
    trace,
    train,
)
from tests.dist.harness import run_ranks
from tests.dist.test_pipeline import STEPS, _raw
from trainers.config import parse_config
from trainers.models import moe_layers
from trainers.trainer import Trainer, TrainerCallback

pytestmark = pytest.mark.dist

BASE = {"vocab_size": 257, "dim": 32, "n_layers": 4, "n_heads": 2, "max_seq_len": 32}
FSDP = {"engine": "fsdp"}
EQUIVALENCE = {  # name: (moe config, parallel) on 4 processes, each against one process
    "dp4-ep4-top2-dropless": ({"num_experts": 4, "top_k": 2}, {**FSDP, "ep": 4}),
    "dp4-ep2-top1-capacity": ({"num_experts": 4, "top_k": 1, "capacity_factor": 1.0}, {**FSDP, "ep": 2}),
}
FIXED = {  # name: moe config; pp=2 x dp=2 x ep=2 with the fixed routing
    "dropless-top2": {"num_experts": 4, "top_k": 2},
    "capacity-top2": {"num_experts": 4, "top_k": 2, "capacity_factor": 1.0},
    "capacity-top1": {"num_experts": 4, "top_k": 1, "capacity_factor": 1.0},
}
E, SEQ, MICRO, GLOBAL = 4, 32, 2, 8


def _choices(pos: int) -> tuple[int, int]:
    """The fixed routing: the first half of every sequence picks experts (0, 1); the second half
    cycles through (p mod 4, p + 1 mod 4). Expert 0 is overloaded, experts 2 and 3 underused."""
    return (0, 1) if pos < SEQ // 2 else (pos % E, (pos + 1) % E)


class _FixedRouter:
    """Forward hook on a router: adds 100 to each token's first choice and 50 to its second, by the
    token's position in its sequence. Test code, put on the model from outside."""

    def __init__(self):
        logits = torch.zeros(SEQ, E)
        for pos in range(SEQ):
            first, second = _choices(pos)
            logits[pos, first], logits[pos, second] = 100.0, 50.0
        self.logits = logits

    def __call__(self, module: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        return out + self.logits.repeat(out.shape[0] // SEQ, 1).to(out.dtype)


class _FixedRouting(TrainerCallback):
    def on_model_built(self, trainer: Trainer, model: nn.Module) -> None:
        for moe in moe_layers(model):
            moe.gate.register_forward_hook(_FixedRouter())


def _train_fixed(rank: int, world: int, raws: dict[str, dict]) -> None:
    for raw in raws.values():
        Trainer(parse_config(raw), callbacks=[_FixedRouting()], progress=False).fit()


def _expected(moe: dict) -> dict:
    """Counted by hand from `_choices`: per micro-batch (MICRO sequences) each expert keeps
    min(capacity, requested) of its assignments; a step has GLOBAL / MICRO micro-batches in all."""
    top_k = moe["top_k"]
    requested = [0] * E
    for _ in range(MICRO):
        for pos in range(SEQ):
            for e in _choices(pos)[:top_k]:
                requested[e] += 1
    tokens = MICRO * SEQ
    factor = moe.get("capacity_factor")
    capacity = math.ceil(tokens * top_k / E * factor) if factor else tokens * top_k
    kept = [min(capacity, r) for r in requested]
    micro_batches = GLOBAL // MICRO
    return {
        "tokens_per_expert": [k * micro_batches for k in kept],
        "dropped_fraction": 1 - sum(kept) / sum(requested),
        "imbalance": max(kept) / (sum(kept) / E),
    }


def test_expected_values_are_what_the_routing_rule_gives():
    """The hand count itself, written out for the configurations used below (x4 micro-batches)."""
    assert _expected(FIXED["dropless-top2"]) == {
        "tokens_per_expert": [192, 192, 64, 64],
        "dropped_fraction": 0.0,
        "imbalance": 1.5,
    }
    assert _expected(FIXED["capacity-top2"]) == {  # capacity 32 per expert per micro-batch
        "tokens_per_expert": [128, 128, 64, 64],
        "dropped_fraction": 0.25,
        "imbalance": 32 / 24,
    }
    assert _expected(FIXED["capacity-top1"]) == {  # capacity 16; expert 0 asked for 40
        "tokens_per_expert": [64, 32, 32, 32],
        "dropped_fraction": 0.375,
        "imbalance": 1.6,
    }


# ---------------------------------------------------------------------------------------- fixtures


def _model(moe: dict) -> dict:
    return {**BASE, "moe": moe}


@pytest.fixture(scope="module")
def runs(corpus_dir, tmp_path_factory) -> dict:
    """One spawn of 4 processes: the equivalence runs, then the fixed-routing runs; references here."""
    root = tmp_path_factory.mktemp("expert")
    equivalence = {n: _raw(corpus_dir, root / n, _model(m), p) for n, (m, p) in EQUIVALENCE.items()}
    fixed = {n: _raw(corpus_dir, root / n, _model(m), {**FSDP, "pp": 2, "ep": 2}) for n, m in FIXED.items()}
    traces = merged(run_ranks(_train_ep, 4, equivalence, fixed))
    for n, (m, _) in EQUIVALENCE.items():
        train(_raw(corpus_dir, root / f"ref-{n}", _model(m), {}))
    return {
        "equivalence": {n: (root / n, traces[n]) for n in EQUIVALENCE},
        "refs": {n: root / f"ref-{n}" for n in EQUIVALENCE},
        "at_same_params": {  # one process's fp32 and float64 gradients at each run's parameters
            n: one_process_at(traces[n], _raw(corpus_dir, root / f"one-{n}", _model(m), {}))
            for n, (m, _) in EQUIVALENCE.items()
        },
        "fixed": {n: root / n for n in FIXED},
    }


def _train_ep(rank: int, world: int, equivalence: dict, fixed: dict) -> dict:
    out = {name: trace(raw) for name, raw in equivalence.items()}
    _train_fixed(rank, world, fixed)
    return out


# ------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", EQUIVALENCE)
def test_expert_parallel_matches_one_process(name, runs):
    run_dir, got = runs["equivalence"][name]
    ref_dir = runs["refs"][name]
    assert_same_run(run_dir, ref_dir, STEPS)
    assert_as_accurate(got["grads"], *runs["at_same_params"][name])
    got_rows, ref_rows = rows(run_dir), rows(ref_dir)
    for row, ref in zip(got_rows, ref_rows):  # the same routing: the same loads, summed over the 4 ranks
        assert row["moe_tokens_per_expert"] == ref["moe_tokens_per_expert"]
        assert row["moe_dropped_fraction"] == pytest.approx(ref["moe_dropped_fraction"], abs=1e-7)
    dropping = EQUIVALENCE[name][0].get("capacity_factor") is not None
    assert all((row["moe_dropped_fraction"] > 0) == dropping for row in got_rows)


@pytest.mark.parametrize("name", FIXED)
def test_metrics_on_a_fixed_routing_equal_the_hand_count(name, runs):
    fixed_rows = rows(runs["fixed"][name])
    assert [r["step"] for r in fixed_rows] == list(range(1, STEPS + 1))
    expected = _expected(FIXED[name])
    for row in fixed_rows:
        # 4 MoE layers, 2 on each pipeline stage: every one reports the whole step's global batch.
        assert row["moe_tokens_per_expert"] == [expected["tokens_per_expert"]] * BASE["n_layers"]
        assert row["moe_dropped_fraction"] == pytest.approx(expected["dropped_fraction"], abs=1e-7)
        assert row["moe_load_imbalance"] == pytest.approx(expected["imbalance"], rel=1e-6)
        assert row["moe_load_imbalance_max"] == pytest.approx(expected["imbalance"], rel=1e-6)
