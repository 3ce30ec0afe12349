"""bench/population_scale.py (issue 68): where two population states differ and the targets' verdict (no Ray);
and one tiny run of the script (population 4, 6 reports per member, every scheduler: ~20 s) through its CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import population_scale as ps  # noqa: E402


def test_first_difference_names_the_member_and_its_fields():
    member = {"step": 100, "perturbed": 50, "decisions": 2, "pin": "p"}
    live = {"members": {"a": member, "b": {**member, "decisions": 3}}, "exploits": 1, "history": [[1, 2]]}
    assert ps.first_difference(live, json.loads(json.dumps(live))) is None
    rebuilt = {**live, "members": {"a": member, "b": {**member, "decisions": 2, "perturbed": 100}}}
    assert ps.first_difference(live, rebuilt) == {
        "member": "b", "members_differing": 1,
        "fields": {"decisions": {"live": 3, "rebuilt": 2}, "perturbed": {"live": 50, "rebuilt": 100}},
    }
    assert ps.first_difference(live, {**live, "history": [[1, 2], [3, 4]]}) == {
        "key": "history", "index": 1, "lengths": [1, 2], "live": [], "rebuilt": [[3, 4]]}
    assert ps.first_difference(live, {**live, "exploits": 2}) == {"key": "exploits", "live": 1, "rebuilt": 2}


def _arm(scheduler, population=256, report=10.0, decision=100.0, replay=1.0, equal=True):
    return {"population": population, "scheduler": scheduler, "report_ms": {"p99": report},
            "decision_ms": {"p99": decision}, "replay_s": replay, "replay_equal": equal, "history_points": 7,
            "history_kept": 5, "rss_per_report_bytes": 12.0}


def test_done_when_is_judged_at_population_256_only():
    assert ps.done_when([_arm("pbt", population=8), _arm("pb2", population=8)])["holds"] is None
    good = ps.done_when([_arm("pbt"), _arm("pb2"), _arm("pbt_sync", decision=1e5)])
    assert good["holds"] is True and good["pb2_history_points"] == 7
    slow = ps.done_when([_arm("pbt"), _arm("pb2", decision=600.0)])
    assert slow["holds"] is False and slow["pb2"]["decision_p99_ms"] is False
    assert ps.done_when([_arm("pbt", equal=False), _arm("pb2")])["pbt"]["replay_equal"] is False


def test_the_real_results_need_the_default_arms():
    with pytest.raises(SystemExit):
        ps.parse_args(["--populations", "8"])
    assert ps.parse_args(["--populations", "8", "--out", "/tmp/elsewhere"]).populations == [8]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("population_scale")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "bench" / "population_scale.py"), "--populations", "4",
                    "--reports", "6", "--period", "0.05", "--out", str(out)], check=True, env=env, timeout=120, capture_output=True)
    return json.loads((out / "population_scale.json").read_text()), out


def test_a_tiny_run_writes_every_field(tiny_run):
    result, out = tiny_run
    assert (out / "population_scale.png").stat().st_size > 0
    for key in ("command", "git_commit", "versions", "loadavg_before", "measures", "setup", "arms", "targets",
                "done_when"):
        assert key in result
    assert result["measures"] == sorted(ps.MEASURES)
    assert [(a["population"], a["scheduler"]) for a in result["arms"]] == [(4, s) for s in ps.SCHEDULERS]
    for a in result["arms"]:
        assert a["reports_per_member"]["min"] >= 1  # an exploit may skip steps (or redo them)
        assert a["exploits"] == a["actor_exploits"] == a["replay_rows"]["exploits"]
        assert a["replay_rows"]["reports"] == a["reports"] and a["capped"] == 0
        assert a["report_ms"]["p99"] > 0 and a["decision_ms"]["n"] > 0 and a["rss_end_bytes"] > 0
        assert a["lineage_files"] == 4 and a["lineage_bytes"] > 0 and a["replay_s"] > 0
        assert isinstance(a["replay_equal"], bool) and (a["replay_difference"] is None) == a["replay_equal"]
    assert result["done_when"]["holds"] is None  # population 256 not run


def test_a_tiny_run_replays_to_the_live_state(tiny_run):
    result, _ = tiny_run
    assert {a["scheduler"]: a["replay_difference"] for a in result["arms"]} == {s: None for s in ps.SCHEDULERS}
