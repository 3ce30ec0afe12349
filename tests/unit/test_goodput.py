"""raytrain_ext.result.goodput on made-up records: a run that lost no time keeps 1.0 whatever each step costs
beside its own `step_time_s`; a pause, steps at fewer groups and steps trained again each count against it."""

from __future__ import annotations

import pytest

from raytrain_ext.result import goodput


def _rows(times: list[float], sizes: list[int] | None = None, step_time_s: float = 0.05) -> list[dict]:
    sizes = sizes or [3] * len(times)
    return [{"step": i + 1, "time": t, "step_time_s": step_time_s, "replicas": n}
            for i, (t, n) in enumerate(zip(times, sizes))]


def test_a_run_that_lost_no_time_keeps_it_all_whatever_a_step_costs_beside_its_step_time():
    # each step takes 0.1 s of wall time, of which its own step_time_s is half (its record, the next quorum)
    rows = _rows([0.05 + 0.1 * i for i in range(100)])
    assert goodput(rows) == pytest.approx(1.0, abs=1e-3)


def test_a_pause_and_slower_steps_at_fewer_groups_count_against_it():
    times = [0.05 + 0.1 * i for i in range(50)]
    times += [times[-1] + 2.0 + 0.15 * i for i in range(20)]  # a 2 s pause, then 20 steps at 2 of 3 groups
    times += [times[-1] + 0.1 * (i + 1) for i in range(30)]
    rows = _rows(times, [3] * 50 + [2] * 20 + [3] * 30)
    wall = times[-1]  # (the first step started at 0)
    assert goodput(rows) == pytest.approx(100 * 0.1 / wall, rel=1e-3)
    assert goodput(rows) < 0.9


def test_without_two_consecutive_steps_at_full_size_a_steps_own_time_is_taken():
    rows = _rows([0.05, 1.0, 3.0], sizes=[3, 2, 3])
    assert goodput(rows) == pytest.approx(3 * 0.05 / 3.0, rel=1e-3)
    assert goodput(rows[:1]) is None
