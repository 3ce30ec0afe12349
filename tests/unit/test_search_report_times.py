"""`raytrain tune report`'s account of the trials' time outside training steps (issue 25): the parts the
trials measured (search.times) as shares of their wall time, the rest as reporting; and time-sharing's
line (members at once, yields per member)."""

from __future__ import annotations

from types import SimpleNamespace

from search.report import time_outside_steps, turns


def _row(trial, wall, steps, yielded=False, running=None, **parts):
    return {"trial": trial, "failed": False, "wall_s": wall, "steps_s": steps, "yielded": yielded, "running": running, **parts}


def test_time_outside_steps_names_its_parts_and_the_rest_is_reporting():
    rows = [
        _row("a", 10.0, 5.0, start_s=2.0, eval_s=0.5, slot_s=1.0),
        _row("b", 10.0, 6.0, decision_s=1.5, checkpoint_s=0.5),
        {**_row("c", 99.0, 0.0, start_s=99.0), "failed": True},  # a failed report trained nothing: left out
    ]
    line = time_outside_steps(rows)
    # of 20 s, 11 in steps: 45% outside = start 10%, decisions 7.5%, slot 5%, eval 2.5%, checkpoints 2.5%
    assert line.startswith("time outside training steps: 45.0% of trial time: starting Train runs 10.0%")
    assert "waiting for the scheduler's decisions 7.5%" in line and "waiting for a slot (time-sharing) 5.0%" in line
    assert "evaluation 2.5%" in line and "checkpoints holding training 2.5%" in line
    assert line.endswith("reporting 17.5%")  # 45 - 27.5


def test_older_logs_without_parts_keep_the_total_only():
    assert time_outside_steps([_row("a", 10.0, 4.0)]) == "time outside training steps: 60.0% of trial time"


def test_turns_counts_members_at_once_and_yields():
    exp = SimpleNamespace(population=4)
    rows = [_row("a", 1, 1, True, 2), _row("a", 1, 1, True, 2), _row("b", 1, 1, False, 1), _row("b", 1, 1, True, 2)]
    assert turns(exp, rows) == (
        "time-sharing: at most 2 of 4 members ran at once; each yielded its slot 1.5 times on average (min 1, max 2)"
    )
    assert turns(exp, [_row("a", 1, 1)]) is None  # not time-shared: no line
