"""bench/pbt_quality.py (issue 66): the paired statistics against scipy's, the held-out split, the verdict and the
JSON computed from per-seed rows (no Ray, fast), the judged arm being the product's default rule; and, marked
slow, one `--dry-run` of the real harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sklearn.gaussian_process  # noqa: F401  (scikit-learn sets KMP_* variables on import: at collection)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import pbt_quality as pq  # noqa: E402


def test_the_exact_wilcoxon_p_is_scipys():
    from scipy.stats import wilcoxon

    rng = np.random.default_rng(0)
    for n in (5, 8, 10, 12):
        for _ in range(5):
            d = list(rng.normal(0.01, 0.02, n))
            assert pq.wilcoxon_p(d) == pytest.approx(wilcoxon(d, method="exact").pvalue, rel=1e-9)
    assert pq.wilcoxon_p([0.1] * 10) == pytest.approx(2 / 1024)  # every seed one way: 2 of 1024 sign patterns
    assert pq.wilcoxon_p([0.0, 0.0]) is None
    assert pq.wilcoxon_p([0.0, 0.1, 0.2, -0.05]) == pq.wilcoxon_p([0.1, 0.2, -0.05])  # zeros dropped


def test_the_sign_test():
    assert pq.sign_p(9, 1) == pytest.approx(2 * 11 / 1024)
    assert pq.sign_p(5, 5) == 1.0 and pq.sign_p(0, 0) is None


def _arm(seeds, losses, steps=6400):
    return {"seeds": list(seeds), "test_loss": list(losses), "total_steps": [steps] * len(losses)}


def test_paired_verdicts_are_over_common_seeds_and_need_the_test():
    seeds = range(100, 110)
    pbt = [1.85 + 0.01 * (i % 3) for i in range(10)]
    better = pq.paired(_arm(seeds, pbt), _arm(seeds, [v + 0.02 + 0.001 * i for i, v in enumerate(pbt)]))
    assert better["wins"] == 10 and better["verdict"] == "better" and better["median"] > 0
    worse = pq.paired(_arm(seeds, pbt), _arm(seeds, [v - 0.02 for v in pbt]))
    assert worse["verdict"] == "worse" and worse["losses"] == 10
    mixed = pq.paired(_arm(seeds, pbt), _arm(seeds, [v + (0.01 if i % 2 else -0.011) for i, v in enumerate(pbt)]))
    assert mixed["verdict"] == "no difference shown"
    few = pq.paired(_arm(seeds, pbt), _arm([100, 101, 999], [2.0, 2.0, 2.0]))
    assert few["seeds"] == [100, 101] and few["verdict"] == "no difference shown"  # 2 seeds: p = 0.5


def test_the_test_windows_start_past_the_selections_document():
    seq, sel, eos = 4, 3, 9
    tokens = np.zeros(60, dtype=np.int64)
    tokens[[20, 41]] = eos  # the selection (windows 0-2: tokens 0-12) lies in the document ending at 20
    s = pq.test_windows(tokens, seq, sel, eos)
    assert s["selection"]["windows"] == [0, 2] and s["test"]["document_disjoint"]
    assert s["test"]["windows"] == [6, 13] and s["ids"][0] * seq > 20  # window 5 starts at 20, the end token
    assert s["test"]["count"] == len(s["ids"]) == 8 and s["test"]["documents"] == 2
    s = pq.test_windows(np.zeros(60, dtype=np.int64), seq, sel, eos)  # one document: right after the selection
    assert s["test"]["windows"][0] == 3 and not s["test"]["document_disjoint"]
    with pytest.raises(SystemExit):
        pq.test_windows(tokens, seq, 20, eos)


def _rows(seeds, gap=0.02, steps=6400):
    rows = []
    for k, seed in enumerate(seeds):
        base = 1.88 + 0.01 * (k % 4)
        for m, loss in (("pbt", base), ("random", base + gap + 0.001 * k), ("asha", base + gap), ("hand", base - 0.03)):
            row = {"method": m, "seed": seed, "run_seed": pq.run_seed(seed), "test_loss": loss, "selection_loss": loss,
                   "total_steps": 1600 if m == "hand" else steps, "wall_s": 60.0, "picked": {}}
            if m != "hand":
                row.update(trials=4, exploits=3 if m == "pbt" else 0, pick_checked=True)
            rows.append(row)
    return rows


def _results(tmp_path, seeds, **kw):
    args = pq.parse_args(["--work", str(tmp_path / "w"), "--out", str(tmp_path / "o"), "--seeds", *map(str, seeds)])
    sel = {"selection": {"count": 128}, "test": {"count": 2635}, "ids": [1, 2]}
    return pq.results(args, _rows(seeds, **kw), sel, (0.0, 0.0, 0.0), 0.0)


def test_the_verdict_holds_only_with_fresh_seeds_equal_steps_and_a_paired_win(tmp_path):
    fresh = list(range(100, 110))
    out = _results(tmp_path, fresh)
    done = out["done_when"]
    assert done["holds"] and done["verdicts"] == {"random": "better", "asha": "better"}
    assert done["gap_to_hand"] == pytest.approx(-0.03)  # the hand schedule 0.03 below PBT at every seed
    assert out["setup"]["fresh_seeds"] == fresh and out["setup"]["scheduler"] == pq.DEFAULTS.model_dump(mode="json")
    assert out["methods"]["pbt"]["run_seeds"] == [1000 + s for s in fresh]
    assert out["verdict_rule"] == pq.VERDICT_RULE and "ids" not in out["split"]
    assert set(out["measures"]) == set(pq.MEASURES)
    for key in ("command", "git_commit", "git_dirty", "versions", "date", "cpus", "loadavg_before", "wall_s"):
        assert key in out, key
    json.dumps(out)  # written whole
    pq.plot(out, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert not _results(tmp_path, list(range(10)))["done_when"]["holds"]  # the seeds that chose the settings
    assert not _results(tmp_path, fresh[:9])["done_when"]["holds"]
    off = _results(tmp_path, fresh, steps=6500)  # 1.6% over the budget of 4 x 1600
    assert not off["equal_steps"]["holds"] and not off["done_when"]["holds"]
    assert _results(tmp_path, fresh, gap=0.0)["done_when"]["verdicts"]["asha"] == "no difference shown"


def test_arguments():
    with pytest.raises(SystemExit):
        pq.parse_args(["--dry-run"])  # never over the real results
    quick = pq.parse_args(["--quick"])
    assert quick.steps == 400 and quick.seeds == pq.QUICK_SEEDS and quick.asha_samples == 4 * 400 // pq.DEFAULTS.interval
    full = pq.parse_args([])
    assert full.asha_samples == 4 * 1600 // full.interval  # the budget, not the samples, ends ASHA
    assert full.steps == 1600 and len(full.seeds) == 10 and not set(full.seeds) & set(pq.SEEDS_THAT_CHOSE_SETTINGS)
    assert full.interval == pq.DEFAULTS.interval and full.methods == ["pbt", "random", "asha", "hand"]
    with pytest.raises(SystemExit):
        pq.parse_args(["--steps", "430"])
    lineage = pq.hand_lineage(full)
    assert lineage[1][0] == 1400 and lineage[1][1] == pytest.approx(0.3 * lineage[0][1])


def test_the_budget_stopper_counts_a_finished_trials_repeated_last_result_once():
    """Tune hands a stopper a function trial's last result again when it ends (done=True); counted twice, the
    experiment stopped while its last trial still had 50-100 steps of the budget to train."""
    stop = pq._budget_stop(200)
    for trial in ("a", "b"):
        for it in (1, 2):
            stop(trial, {"trained": 50, "training_iteration": it})
        stop(trial, {"trained": 50, "training_iteration": 2, "done": True})  # the repeat
    assert stop.reported == 200 and stop.stop_all()
    fresh = pq._budget_stop(200)
    fresh("a", {"trained": 50, "training_iteration": 1})
    fresh("a", {"trained": 50, "training_iteration": 1, "done": True})
    assert not fresh.stop_all()


def test_the_judged_arm_is_the_products_default_rule(corpus_dir, tmp_path):
    args = pq.parse_args(["--data", str(corpus_dir), "--work", str(tmp_path)])
    exp = pq.experiment(args, "pbt", 103)
    assert exp.scheduler == pq.DEFAULTS and exp.scheduler.name == "pbt" and not exp.scheduler.synch
    assert exp.seed == 103 and exp.population == 4 and exp.steps == 1600
    cfg = exp.run_config(exp.members()[0], name="t", run_dir=str(tmp_path / "r"))
    assert cfg.seed == 1103 and cfg.schedule.name == "constant" and cfg.model.dim == 32
    assert pq.experiment(args, "pbt_sync", 103).scheduler.synch
    asha = pq.experiment(args, "asha", 103)
    assert asha.population == 4 * 1600 // 50 and asha.scheduler.grace_period is None  # the interval, as the product's
    assert asha.members()[:4] == exp.members()  # the same first draws


@pytest.mark.slow
def test_dry_run_of_the_real_harness(corpus_dir, tmp_path):
    """Tune function trials running the Trainer under one budget; PBT restores from pins; every pick re-scored."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pbt_quality.py"), "--dry-run", "--data", str(corpus_dir),
         "--out", str(out), "--work", str(work)],
        check=True, env=env, timeout=900, capture_output=True,
    )
    result = json.loads((out / "pbt_quality.json").read_text())
    assert set(result["methods"]) == {"pbt", "random", "asha", "hand"}
    assert result["equal_steps"]["holds"] and result["equal_steps"]["counted"]["pbt"] == [16, 16]
    for m in ("pbt", "random", "asha"):
        assert all(result["methods"][m]["pick_checked"]) and len(result["methods"][m]["test_loss"]) == 2
    assert set(result["paired"]) == {"random", "asha", "hand"}
    assert (out / "pbt_quality.png").stat().st_size > 0


def test_the_pb2_arm_before_issue_68_fits_every_point_cold_and_unbounded(monkeypatch):
    """`pb2_before` (bench/pb2_window.py's PopulationBefore): no window, each fit from scikit-learn's starting
    kernel at scipy's default bound, in whatever process runs the fit; the product's bound is back after it."""
    import pickle

    import pb2_window as pw

    from search import population
    from search.schedulers import SchedulerConfig

    pop = pw.PopulationBefore(SchedulerConfig(name="pb2", interval=1), pw.SPACE, "min", 10**9, 2, seed=0)
    assert pop.window is None and type(pickle.loads(pickle.dumps(pop))) is pw.PopulationBefore
    for step in range(1, 4):
        for i in range(2):
            pop.record(f"t{i}", i, step, 3.0 - 0.1 * step * (i + 1), {"optimizer.lr": 1e-3 * (i + 1),
                                                                     "optimizer.weight_decay": 0.1}, f"/p/{i}/{step}")
    pop.gp = pop.fit_job()()  # a fit to start from: the rule before starts cold all the same
    seen = []
    monkeypatch.setattr(population.GPFit, "fit", classmethod(lambda cls, *a, **kw: seen.append(
        (population.GP_MAX_EVALS, kw["start"]))))
    job = pickle.loads(pickle.dumps(pop.fit_job()))
    job()
    assert seen == [(15_000, None)] and population.GP_MAX_EVALS == 50
