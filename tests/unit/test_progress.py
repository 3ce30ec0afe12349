"""The console of a run that is not watched on a terminal: plain lines, a bounded number of them."""

from __future__ import annotations

import io

from trainers.progress import LineProgress, plain, progress_bar


def test_a_log_file_gets_a_line_per_tenth_of_the_run_with_the_latest_values_and_no_escapes():
    out = io.StringIO()
    bar = progress_bar(600, "t", file=out)
    assert isinstance(bar, LineProgress)
    for step in range(1, 601):
        bar.update(1)
        bar.set_postfix(loss=f"{6 - step / 200:.3f}", val=None, workers=2)
    bar.write("\x1b[36mresumed from step 5 on 2 workers\x1b[0m")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11, lines  # 10 tenths and the event line; close adds nothing at 600/600
    assert lines[0].startswith("t: step 60/600 (10%), loss=5.700, workers=2, ")
    assert lines[9].startswith("t: step 600/600 (100%), loss=3.000")
    assert lines[10] == "resumed from step 5 on 2 workers"
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()


def test_a_run_stopped_between_tenths_says_where_it_stopped():
    out = io.StringIO()
    bar = LineProgress(100, "t", initial=40, file=out)
    for _ in range(5):
        bar.update(1)
        bar.set_postfix(loss="1.000")
    bar.close()
    assert out.getvalue().splitlines()[-1].startswith("t: step 45/100 (45%), loss=1.000")


def test_without_progress_only_events_are_printed():
    out = io.StringIO()
    bar = LineProgress(10, "t", file=out, show=False)
    bar.n = 10
    bar.set_postfix(loss="1.000")
    bar.write("step 4: resized 2 -> 1 workers (accumulation 2)")
    bar.close()
    assert out.getvalue().splitlines() == ["step 4: resized 2 -> 1 workers (accumulation 2)"]


def test_plain_removes_colors_and_cursor_moves():
    assert plain("\x1b[36m(RayTrainWorker pid=3)\x1b[0m loss \x1b[2K\x1b[1A") == "(RayTrainWorker pid=3) loss "
