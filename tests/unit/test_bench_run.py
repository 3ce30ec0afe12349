"""bench/run.py's summaries on made-up runs (no timing: the benchmark itself measures): per-pair ratios
with their spread, and no headline when other processes took the CPUs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import run as bench_run  # noqa: E402
from measure import summarize_pairs  # noqa: E402


def _run(variant: str, step_s: float, ac: str = "off", other: float = 0.01) -> dict:
    return {
        "variant": variant,
        "ac": ac,
        "losses": [2.0, 1.9, 1.8, 1.7, 1.6, 1.5],
        "step_times_s": [step_s, step_s * 1.01, step_s * 0.99],
        "step_cpu_times_s": [2 * step_s] * 3,
        "step_minor_faults": [0, 10, 0],
        "rss_added_bytes": 100 * 2**20 if ac == "off" else 60 * 2**20,
        "live_tensor_peak_bytes": 400 * 2**20 if ac == "off" else 150 * 2**20,
        "live_tensor_start_bytes": 50 * 2**20,
        "torch_threads": 2,
        "other_processes_cpu_share": other,
    }


def _overhead(trainer_steps: list[float], other: float = 0.01) -> list[dict]:
    runs = []
    for t in trainer_steps:
        runs += [_run("trainer", t, other=other), _run("plain", 1.0, other=other)]
    return runs


def test_ratio_is_the_median_of_the_pairs_with_its_spread():
    summary = summarize_pairs(_overhead([1.0, 1.02, 1.01, 1.2, 0.99]))
    assert summary["per_pair_ratios"] == pytest.approx([1.0, 1.02, 1.01, 1.2, 0.99])
    assert summary["ratio_median"] == pytest.approx(1.01)
    assert summary["ratio_p10"] == pytest.approx(0.994)  # numpy's linear interpolation
    assert summary["ratio_p90"] == pytest.approx(1.128)
    assert summary["same_math"]["max_rel_diff_first"] == 0.0


def test_different_losses_are_refused():
    runs = _overhead([1.0])
    runs[1]["losses"] = [2.0, 1.9, 1.8, 1.7, 1.61, 1.5]
    with pytest.raises(AssertionError, match="same math"):
        summarize_pairs(runs)


def _result(other: float) -> dict:
    overhead = dict(summarize_pairs(_overhead([1.0, 1.02, 1.01])), target_ratio_max=1.03, met=True)
    overhead["runs"] = _overhead([1.0, 1.02, 1.01])
    ac_runs = [_run("trainer", 1.0, "off"), _run("trainer", 1.1, "selective"), _run("trainer", 1.3, "every")]
    ac = bench_run.summarize_ac(ac_runs)
    ac["rss_with_fixed_mmap_threshold"] = {"memory_cut_rss_added": 2.0}
    return {
        "overhead": overhead,
        "activation_checkpointing": ac,
        "other_processes_cpu_share": other,
        "max_other_processes_cpu_share": other,
        "loadavg_at_start": (0.4, 0.3, 0.2),
        "loadavg_at_end": (1.1, 0.5, 0.3),
        "cpus_usable": 2,
        "torch_version": "x",
        "date": "2026-11-30T00:00:00",
    }


def test_headline_on_a_quiet_machine(tmp_path, capsys):
    result = _result(other=0.02)
    headline, refused = bench_run.headline(result, max_other=0.10)
    assert refused is None
    assert headline["trainer_over_plain_median"] == pytest.approx(1.01)
    assert headline["pairs"] == 3 and headline["ac_every_time_ratio"] == pytest.approx(1.3)
    bench_run.print_table(result)
    out = capsys.readouterr().out
    assert "median of 3 pairs 1.010" in out and "AC selective vs off" in out and "in time: True" in out
    bench_run.plot(result, tmp_path / "overhead.png")
    assert (tmp_path / "overhead.png").stat().st_size > 0


def test_no_headline_when_other_processes_took_the_cpus():
    headline, refused = bench_run.headline(_result(other=0.23), max_other=0.10)
    assert headline is None
    assert refused.startswith("other processes used 23% of the CPUs during the run (limit 10%")
