"""The harness itself: ranks really form one group; a rank that dies before it returns is told apart from
one that aborts after (only the first is a crash that `make test` reruns)."""

from __future__ import annotations

import atexit
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist.harness import RankCrashed, run_ranks

pytestmark = pytest.mark.dist


def _sum_of_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_all_reduce_over_two_processes():
    assert run_ranks(_sum_of_ranks, 2) == [1.0, 1.0]


def _abort_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os.abort()  # as glibc does on finding its heap corrupted
    return rank


def _abort_at_exit_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        atexit.register(os.abort)  # after the harness has written this rank's result
    return rank


def test_a_rank_killed_before_it_returns_is_a_crash_with_its_threads_stacks(capfd):
    with pytest.raises(RankCrashed, match="rank 1 of 2 was killed by SIGABRT") as info:
        run_ranks(_abort_on_rank_1, 2)
    assert isinstance(info.value, mp.ProcessExitedException) and info.value.signal_name == "SIGABRT"
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err and "_abort_on_rank_1" in err  # faulthandler's stacks


def test_an_abort_after_the_result_is_a_plain_failure_never_a_crash_to_rerun():
    with pytest.raises(mp.ProcessExitedException, match="terminated with signal SIGABRT") as info:
        run_ranks(_abort_at_exit_on_rank_1, 2)
    assert not isinstance(info.value, RankCrashed)
