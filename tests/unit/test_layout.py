"""Parallel layout (pp x dp x ep) validation and rank arithmetic, the pipeline split, and bad pipeline or
expert configs failing with one line that names the field. No processes."""

from __future__ import annotations

import itertools

import pytest

from trainers.config import ConfigError, parse_config
from trainers.models import ModelConfig, MoEConfig
from trainers.parallel import ParallelLayout
from trainers.parallel.pipeline import block_costs, split_stages


def _message(excinfo: pytest.ExceptionInfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and "fix:" in msg
    return msg


# ------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize(
    ("world", "pp", "ep", "says"),
    [
        (4, 3, 1, "parallel.pp=3 does not divide the world size 4"),
        (6, 2, 2, "parallel.ep=2 does not divide the data-parallel size 3"),
        (4, 1, 3, "parallel.ep=3 does not divide the data-parallel size 4"),
    ],
)
def test_bad_degrees_for_the_world_size(world, pp, ep, says):
    with pytest.raises(ConfigError) as e:
        ParallelLayout.build(world, 0, pp=pp, ep=ep)
    assert says in _message(e)


def test_ranks_are_pp_major_and_ep_inner():
    """world 8 = pp 2 x dp 4, ep 2: stage 0 is ranks 0-3, stage 1 ranks 4-7; in a stage, expert groups
    are consecutive pairs, and ranks 0 and 2 hold the same experts (edp = 2)."""
    layouts = [ParallelLayout.build(8, r, pp=2, ep=2) for r in range(8)]
    assert [lay.pp_rank for lay in layouts] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.dp_rank for lay in layouts] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [lay.ep_rank for lay in layouts] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert {lay.dp for lay in layouts} == {4} and {lay.edp for lay in layouts} == {2}


def test_dp_only_layout_is_unchanged():
    lay = ParallelLayout.build(4, 3)
    assert (lay.dp, lay.pp, lay.ep, lay.dp_rank, lay.pp_rank) == (4, 1, 1, 3, 0)


@pytest.mark.parametrize(
    ("pp", "virtual", "v_shape", "expected"),
    [
        (2, 1, False, [[0], [1]]),
        (2, 2, False, [[0, 2], [1, 3]]),  # looped: Interleaved1F1B's stage-to-rank mapping
        (4, 2, False, [[0, 4], [1, 5], [2, 6], [3, 7]]),
        (2, 2, True, [[0, 3], [1, 2]]),  # V: ZBVZeroBubble's
        (4, 2, True, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_stage_ids(pp, virtual, v_shape, expected):
    got = [ParallelLayout.build(pp, r, pp=pp).stage_ids(virtual, v_shape) for r in range(pp)]
    assert got == expected
    owners = ParallelLayout.build(pp, 0, pp=pp)
    for rank, stages in enumerate(expected):
        assert all(owners.stage_owner(s, v_shape) == rank for s in stages)


# -------------------------------------------------------------------------------------------- split


def _brute_force(costs: list[float], n: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), n - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_equal_blocks_split_by_count():
    assert split_stages([1.0] * 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [len(s) for s in split_stages([1.0] * 5, 2)] == [3, 2]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_split_minimises_the_costliest_stage(n):
    costs = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    stages = split_stages(costs, n)
    assert [i for s in stages for i in s] == list(range(8)) and all(stages)
    assert max(sum(costs[i] for i in s) for s in stages) == _brute_force(costs, n)


def test_moe_blocks_weigh_their_experts():
    """Blocks 0-2 dense, block 3 MoE running top-4 of 8 experts (~3x a dense block): a count split
    (2 + 2 blocks) would load the second stage ~1.4x the first; the cost split gives the MoE block a
    stage of its own."""
    moe = MoEConfig(num_experts=8, top_k=4, every=4)
    costs = block_costs(ModelConfig(dim=64, n_heads=4, n_layers=4, max_seq_len=64, moe=moe), 64)
    assert costs[0] == costs[1] == costs[2] and costs[3] > 3 * costs[0]
    assert split_stages(costs, 2) == [[0, 1, 2], [3]]


# ---------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("sections", "starts"),
    [
        ({"parallel": {"pp": 2}}, "parallel.pp=2 needs parallel.engine=fsdp"),
        ({"parallel": {"engine": "ddp", "ep": 2}}, "parallel.ep=2 needs parallel.engine=fsdp"),
        ({"parallel": {"engine": "fsdp", "pp": 8}}, "parallel.pp=8 x virtual_stages=1 = 8 pipeline stages"),
        (
            {
                "parallel": {
                    "engine": "fsdp",
                    "pp": 2,
                    "pipeline_schedule": "interleaved_1f1b",
                    "virtual_stages": 4,
                }
            },
            "parallel.pp=2 x virtual_stages=4",
        ),
        ({"parallel": {"engine": "fsdp", "pp": 2, "virtual_stages": 2}}, "parallel.virtual_stages=2 needs"),
        (
            {"parallel": {"engine": "fsdp", "pp": 2, "pipeline_schedule": "zbv"}},
            "parallel.pipeline_schedule=zbv",
        ),
        (
            {"parallel": {"engine": "fsdp", "n_microbatches": 4}},
            "parallel.virtual_stages=1, n_microbatches=4",
        ),
        ({"parallel": {"engine": "fsdp", "ep": 2}}, "parallel.ep=2 needs an MoE model"),
        (
            {"parallel": {"engine": "fsdp", "ep": 3}, "model": {"moe": {"num_experts": 4}}},
            "parallel.ep=3 does not divide model.moe.num_experts=4",
        ),
        (
            {"parallel": {"engine": "fsdp", "pp": 2}, "precision": {"dtype": "fp16"}},
            "precision.dtype=fp16 with parallel.pp > 1",
        ),
        (
            {"parallel": {"engine": "fsdp", "pp": 2}, "model": {"tie_embeddings": True}},
            "model.tie_embeddings",
        ),
        (
            {
                "parallel": {
                    "engine": "fsdp",
                    "pp": 2,
                    "zero_stage": 3,
                    "pipeline_schedule": "zbv",
                    "virtual_stages": 2,
                }
            },
            "parallel.zero_stage=3 with pipeline_schedule=zbv",
        ),
    ],
)
def test_bad_pipeline_or_expert_config_names_the_field(sections, starts):
    with pytest.raises(ConfigError) as e:
        parse_config({"data": {"path": "d"}, **sections})
    assert _message(e).startswith(starts)


def test_good_pipeline_config_parses():
    cfg = parse_config(
        {
            "data": {"path": "d"},
            "model": {"n_layers": 8, "moe": {"num_experts": 8}},
            "parallel": {"engine": "fsdp", "pp": 2, "ep": 4, "pipeline_schedule": "zbv", "virtual_stages": 2},
        }
    )
    assert (cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.virtual_stages) == (2, 4, 2)
