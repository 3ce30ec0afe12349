"""The harness itself: ranks really form one group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _sum_of_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_all_reduce_over_two_processes():
    assert run_ranks(_sum_of_ranks, 2) == [1.0, 1.0]
