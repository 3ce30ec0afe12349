"""bench/pbt_quality.py: the results' contract (issue 25) and the done-when computed from the numbers, over
summaries that the harness's own summarizer makes from trial logs (no Ray, fast); and one `--dry-run` of the
real harness (Tune function trials running the Trainer, PBT restoring from checkpoints) for one method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import pbt_quality  # noqa: E402

CONTRACT = ("best_val_loss", "total_steps", "wall_s")


def _fake_experiment(work: Path, method: str, population: int, seed: int, losses: list[float]) -> None:
    """A trial log as the trainable writes it: two trials, two reports each; the second trial's state at
    step 100 came from the first's at step 50 (an exploit: its lineage holds the donor's hyperparameters)."""
    d = work / pbt_quality.experiment_name(method, population, seed)
    d.mkdir(parents=True)
    rows = []
    for t, loss in enumerate(losses):
        for step, val in ((50, loss + 0.1), (100, loss)):
            lineage = [[0, 1e-3 * (t + 1), 0.1]] + ([[50, 5e-4, 0.1]] if t == 1 and step == 100 else [])
            rows.append({"trial": f"t{t}", "step": step, "val_loss": val, "trained": 50, "lr": 1e-3 * (t + 1),
                         "wd": 0.1, "restored_at": None, "interval_s": 1.0, "time": float(step + t),
                         "lineage": lineage})
    (d / pbt_quality.LOG).write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = pbt_quality.summarize_experiment(d, 12.5, method, seed)
    if method in pbt_quality.REPLAYED:  # what run_one adds: the replay of the best lineage
        summary["replay"] = {"step": 100, "val_loss": summary["best_val_loss"] + 0.001 * (-1) ** seed,
                             "reported": summary["best_val_loss"], "lineage": summary["best_lineage"]}
    (d / pbt_quality.SUMMARY).write_text(json.dumps(summary))


def test_summarize_only_writes_the_contract_and_computes_the_verdict(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    base = {"pbt": 1.84, "pbt_sync": 1.80, "pb2": 1.95, "asha": 1.95, "random": 1.97, "grid": 1.82}
    seeds = 5
    for population, shift in ((8, 0.0), (4, 0.05)):
        for method, loss in base.items():
            if method == "grid" and population == 4:
                continue  # one grid, shown beside every population
            for seed in range(1 if method == "grid" else seeds):
                _fake_experiment(work, method, population, seed, [loss + shift + 0.002 * seed, loss + 0.3])
    pbt_quality.main(["--summarize-only", "--work", str(work), "--out", str(out), "--seeds", str(seeds),
                      "--populations", "8", "4", "--data", str(tmp_path)])
    result = json.loads((out / "pbt_quality.json").read_text())
    assert set(result["methods"]) == set(pbt_quality.ALL) and result["setup"]["population"] == 8
    for method, m in result["methods"].items():
        n = 1 if method == "grid" else seeds
        for key in CONTRACT:
            assert len(m[key]) == n, (method, key)
        assert m["best_val_loss"] == pytest.approx([base[method] + 0.002 * s for s in range(n)])
        assert m["total_steps"] == [200] * n  # every report's own steps, summed
    assert result["methods"]["pbt"]["best_lineage"][0] == [[0, 1e-3, 0.1]]
    for key in ("task", "harness", "command", "git_commit", "date", "cpus", "loadavg_before", "loadavg_after"):
        assert result[key] is not None, key
    assert {"what", "why"} <= set(result["task"])
    done = result["done_when"]
    assert done["pbt_method"] == "pbt_sync"  # the better of the two PBTs
    assert done["beats_random"]["holds"] and done["beats_asha"]["holds"] and done["pb2_no_worse_than_random"]["holds"]
    assert done["holds"] is True
    assert done["beats_random"]["margin"] == pytest.approx(0.17)
    assert done["paired"]["random"]["wins"] == 5 and done["paired"]["random"]["t"] is None  # 0.17 at every seed
    replay = result["replay"]
    assert replay["holds"] and replay["pbt_sync"]["gaps"] == pytest.approx([0.001 * (-1) ** s for s in range(5)])
    four = result["by_population"]["4"]
    assert four["methods"]["pbt"]["best_val_loss"] == pytest.approx([1.89 + 0.002 * s for s in range(5)])
    assert four["methods"]["grid"]["best_val_loss"] == pytest.approx([1.82])  # the same grid
    assert (out / "pbt_quality.png").stat().st_size > 0


def test_the_verdict_fails_where_the_margin_is_within_the_noise():
    def m(values):
        return {"stats": pbt_quality._stats(values)}

    methods = {"pbt": m([1.80, 1.90, 1.85, 1.82, 1.88]), "pbt_sync": m([1.90] * 5),
               "random": m([1.86, 1.87, 1.85, 1.90, 1.84]), "asha": m([2.0] * 5), "pb2": m([1.86] * 5)}
    done = pbt_quality.verdict(methods)
    assert done["pbt_method"] == "pbt"
    assert not done["beats_random"]["holds"] and done["beats_asha"]["holds"]
    assert done["pb2_no_worse_than_random"]["holds"] and done["holds"] is False
    methods["pb2"] = m([1.95, 1.96, 1.94, 1.95, 1.95])  # worse than random by more than twice its spread
    assert not pbt_quality.verdict(methods)["pb2_no_worse_than_random"]["holds"]


def test_the_paired_comparison_counts_seed_by_seed_wins_beside_the_unpaired_rule():
    def m(values, seeds=range(5)):
        return {"seeds": list(seeds), "best_val_loss": values, "stats": pbt_quality._stats(values)}

    # each seed's luck moves both searches alike: the means differ by less than twice the spread, yet PBT is
    # below random search on every seed, by 0.03 +- 0.01
    random = [1.90, 1.95, 1.86, 1.99, 1.92]
    pbt = [r - d for r, d in zip(random, (0.02, 0.03, 0.04, 0.03, 0.03))]
    done = pbt_quality.verdict({"pbt": m(pbt), "random": m(random), "asha": m([1.9, 1.9, 1.9, 1.9, 2.0])})
    assert not done["beats_random"]["holds"]  # the rule, unchanged
    pair = done["paired"]["random"]
    assert pair["wins"] == 5 and pair["differences"] == pytest.approx([0.02, 0.03, 0.04, 0.03, 0.03])
    assert pair["mean"] == pytest.approx(0.03) and pair["std"] == pytest.approx(0.00707, abs=1e-5)
    assert pair["t"] == pytest.approx(0.03 / (0.0070711 / 5**0.5), rel=1e-4)
    assert done["paired"]["asha"]["wins"] == 3  # PBT 1.88 1.92 1.82 1.96 1.89: above ASHA at seeds 1 and 3
    # only the seeds both ran are paired; fewer than two: no comparison
    assert pbt_quality.paired(m(pbt[:1], seeds=[3]), m(random)) is None
    mixed = pbt_quality.paired(m(pbt[:3], seeds=[0, 1, 7]), m(random))
    assert mixed["seeds"] == [0, 1] and mixed["differences"] == pytest.approx([0.02, 0.03])


def test_replay_check_fails_where_a_replay_misses_by_more_than_the_seed_spread():
    methods = {"pbt": {"stats": pbt_quality._stats([1.80, 1.81, 1.82, 1.80, 1.81]),
                       "replay": [{"val_loss": 1.80, "reported": 1.80}, {"val_loss": 1.90, "reported": 1.81}]}}
    check = pbt_quality.replay_check(methods)
    assert check["pbt"]["gaps"] == pytest.approx([0.0, 0.09]) and check["holds"] is False


def test_dry_run_refuses_the_real_results_folder():
    with pytest.raises(SystemExit):
        pbt_quality.parse_args(["--dry-run"])


@pytest.mark.slow
def test_dry_run_of_the_real_harness(corpus_dir, tmp_path):
    """Tune function trials running the Trainer; PBT reports checkpoints and restores from them."""
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "pbt_quality.py"), "--dry-run", "--data", str(corpus_dir),
         "--out", str(out), "--work", str(work), "--only", "pbt_sync", "grid"],
        check=True, env=env, timeout=600, capture_output=True,
    )
    result = json.loads((out / "pbt_quality.json").read_text())
    assert set(result["methods"]) == {"pbt_sync", "grid"}
    pbt = result["methods"]["pbt_sync"]
    assert len(pbt["best_val_loss"]) == 2 and all(v > 0 for v in pbt["best_val_loss"])
    assert all(t >= 16 for t in pbt["total_steps"])  # population 2 x 8 steps (more if a restore goes back)
    assert sum(pbt["restores"]) > 0  # synchronous PBT pauses every member at each report: restores
    # the replay of each seed's best lineage, from scratch in one run, lands on the reported loss (CPU: exactly)
    for replay in pbt["replay"]:
        assert replay["val_loss"] == pytest.approx(replay["reported"], abs=1e-4), replay
    assert len(result["methods"]["grid"]["best_val_loss"]) == 1
    assert set(result["by_population"]["3"]["methods"]) == {"pbt_sync", "grid"}


def test_hand_schedules_start_at_the_grids_best_rate_and_change_on_report_steps():
    """--hand-schedules (what a schedule is worth on the task): every lineage starts at the grid's middle
    learning rate, changes only on a report step inside the run, and the cascades decay by their factor at every
    decision after half the run, never below the space's lower bound."""
    args = pbt_quality.parse_args(["--work", "/tmp/x", "--out", "/tmp/y"])
    lrs, _ = pbt_quality.grid_values(args)
    schedules = pbt_quality.hand_schedules(args)
    low = pbt_quality.SPACE["optimizer.lr"]["loguniform"][0]
    assert len(schedules) == 8
    for name, lineage in schedules.items():
        assert lineage[0][0] == 0 and lineage[0][1] in (lrs[4], 2 * lrs[4]), name
        steps = [s for s, _, _ in lineage]
        assert steps == sorted(steps) and all(0 < s < args.steps and s % args.interval == 0 for s in steps[1:])
    for factor, name in ((0.5, "factors 2, 0.5"), (0.8, "factors 1.25, 0.8")):
        (cascade,) = [v for k, v in schedules.items() if name in k]
        assert [s for s, _, _ in cascade[1:]] == list(range(900, 1600, 100))
        rates = [lr for _, lr, _ in cascade]
        assert all(b == pytest.approx(max(low, a * factor)) for a, b in zip(rates, rates[1:]))
    assert min(lr for _, lr, _ in schedules[[k for k in schedules if "2, 0.5" in k][0]]) == low


def test_a_task_variant_changes_the_runs_overrides(corpus_dir, tmp_path):
    common = ["--data", str(corpus_dir), "--work", str(tmp_path)]
    args = pbt_quality.parse_args(["--task-set", "model.dim=16", "schedule.name=step", *common])
    exp = pbt_quality.experiment(args, "random", 0, 4)
    cfg = exp.run_config({"optimizer.lr": 1e-3, "optimizer.weight_decay": 0.0}, name="t", run_dir=str(tmp_path / "r"))
    assert cfg.model.dim == 16 and cfg.schedule.name == "step"  # the variant reaches the runs
    assert cfg.model.n_layers == pbt_quality.OVERRIDES["model.n_layers"]  # the rest of the task stays
    plain = pbt_quality.experiment(pbt_quality.parse_args(common), "random", 0, 4)
    assert plain.run_config({}, name="t", run_dir=str(tmp_path / "p")).model.dim == pbt_quality.OVERRIDES["model.dim"]
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        pbt_quality.task_overrides(pbt_quality.parse_args(["--task-set", "model.dim"]))


def test_a_restore_takes_the_step_folder_its_origin_names_where_tune_merged_two_reports(tmp_path):
    # Ray can persist two reports of a trial into one checkpoint folder (a PBT restart reusing the index of
    # the report before): the earlier report's step folder stays beside the later one's and its origin.json
    for step in (1000, 900):
        (tmp_path / f"step_{step:08d}").mkdir()
    pick = pbt_quality.checkpoint_step_folder
    assert pick(tmp_path, {"trial": "t", "step": 1000, "fingerprint": [0.0, 0.0]}).name == "step_00001000"
    assert pick(tmp_path, {"trial": "t", "step": 900, "fingerprint": [0.0, 0.0]}).name == "step_00000900"
    assert pick(tmp_path, None).name == "step_00001000"  # no origin: the latest, not the directory's order
    (tmp_path / "step_00000080").mkdir()  # by step, not by name: 80 < 900 < 1000
    assert pick(tmp_path, None).name == "step_00001000"
