"""The Python API as a notebook uses it: docs/python-api.md's code blocks run in order, in a folder laid out
as the repository is (examples/, data/stdlib), and what they return is checked against what the runs wrote:

- `train()` with no Ray running starts a local one and shuts it down (no Ray process of this one is left);
  its RunResult is the run's metrics file and its final committed checkpoint;
- a bad override raises the one line `raytrain train` and `raytrain tune` print;
- `train()` on a Ray the caller started leaves it running;
- `tune()`: `best` is the best trial of `to_dataframe()`, which has one row per (trial, step) on the current
  branch; `lineage` is lineage.parquet; its local Ray is shut down too; its exploit is loaded into the worse
  member's live run, which trains on from the donor's weights with the explored hyperparameters;
- `trainers`' public names run a run in this process.

The blocks that start Ray run in module fixtures, as tests/ray/conftest.py's Ray fixtures do: what ray.init
leaves in this process's environment (RAY_AUTH_MODE, kept) is there before the tests' leak guard looks.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import pyarrow.parquet as pq
import pytest
import ray  # noqa: F401  (sets RAY_CLIENT_MODE on import: before the leak guard looks)

from raytrain_ext.cli import main
from search.lineage import read_events, read_reports
from tests.ray.conftest import ROOT, ray_env_restored
from tests.ray.test_pbt import _starts, _train_rows
from trainers.checkpoint_files import is_complete
from trainers.metrics import read_metrics

pytestmark = pytest.mark.ray

DOC = ROOT / "docs" / "python-api.md"
TRAIN, BAD_INPUT, JOIN, TUNE, ALONE = range(5)  # the page's python blocks, in order


@dataclass
class Notebook:
    folder: Path
    blocks: list[str]
    namespace: dict[str, Any] = field(default_factory=dict)

    def run(self, index: int, until: str | None = None) -> None:
        """One block, in the folder, with the names the blocks before it made (`until`: its lines before the
        first that starts with this text)."""
        source = self.blocks[index]
        if until is not None:
            source = source[: source.index(f"\n{until}") + 1]
        cwd = os.getcwd()
        os.chdir(self.folder)
        try:
            with ray_env_restored():
                exec(compile(source, f"{DOC.name}, python block {index}", "exec"), self.namespace)
        finally:
            os.chdir(cwd)


@pytest.fixture(scope="module")
def notebook(corpus_dir, tmp_path_factory) -> Notebook:
    folder = tmp_path_factory.mktemp("notebook")
    (folder / "examples").symlink_to(ROOT / "examples")
    (folder / "data").mkdir()
    (folder / "data" / "stdlib").symlink_to(corpus_dir)
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.DOTALL | re.MULTILINE)
    assert len(blocks) == 5, f"{DOC.name}: every python block runs in this test; give a new one its check"
    return Notebook(folder, blocks)


_RAY_PROCESS = re.compile(
    r"raylet|gcs_server|ray-dashboard|ray::|default_worker|dashboard/agent|runtime_env|log_monitor|reaper"
)


def _ray_processes() -> list[str]:
    """This process's descendants that Ray (or our reaper of a local Ray) started."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            text = " ".join([child.name(), *child.cmdline()])
        except psutil.Error:  # ended meanwhile
            continue
        if _RAY_PROCESS.search(text):
            found.append(f"{child.pid}: {text[:100]}")
    return found


def _ray_left(timeout_s: float = 30.0) -> tuple[bool, list[str]]:
    """Whether Ray is still initialised here, and the Ray processes still there after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    return ray.is_initialized(), _ray_processes()


def _no_ray_yet() -> None:
    assert not ray.is_initialized() and _ray_processes() == [], "a Ray from before this test is still running"


# ------------------------------------------------------------------------------------------- train


@pytest.fixture(scope="module")
def trained(notebook):
    _no_ray_yet()
    notebook.run(TRAIN)
    return notebook.namespace["run"], _ray_left()


def test_train_starts_a_local_ray_stops_it_and_returns_the_runs_files(trained, notebook):
    run, left = trained
    assert left == (False, []), "train() left the Ray it started"
    assert run.run_dir == (notebook.folder / "runs" / "tiny-dense").resolve()
    rows = read_metrics(run.run_dir / "metrics.jsonl")
    assert run.metrics == rows
    steps = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in steps] == list(range(1, 21)) and [r["step"] for r in evals] == [10, 20]
    assert (run.step, run.train_loss, run.val_loss) == (20, steps[-1]["loss"], evals[-1]["val_loss"])
    assert run.best_train_loss == min(r["loss"] for r in steps)
    assert run.best_val_loss == min(r["val_loss"] for r in evals)
    assert run.world_sizes == [1]
    committed = sorted(p for p in (run.run_dir / "checkpoints").glob("step_*") if is_complete(p))
    assert run.checkpoint == committed[-1] and run.checkpoint.name == "step_00000020"
    df = run.to_dataframe("train")
    assert list(df["step"]) == list(range(1, 21)) and list(df["loss"]) == [r["loss"] for r in steps]
    assert len(run.to_dataframe()) == len(rows)


def test_bad_override_raises_the_line_the_command_prints(notebook, capsys):
    notebook.run(BAD_INPUT)
    line = capsys.readouterr().out.strip()
    assert line == "unknown key 'optimizer.lrr'; fix: did you mean 'optimizer.lr'?"
    run_yaml = str(notebook.folder / "examples" / "tiny-dense.yaml")
    assert main(["train", run_yaml, "--no-ray", "--set", "optimizer.lrr=0.001"]) == 2
    assert capsys.readouterr().err.strip() == f"raytrain: error: {line}"

    from search import tune
    from trainers import ConfigError

    exp_yaml = str(notebook.folder / "examples" / "pbt-demo.yaml")
    with pytest.raises(ConfigError) as refused:
        tune(exp_yaml, overrides={"population": 0})
    assert main(["tune", exp_yaml, "--set", "population=0"]) == 2
    assert capsys.readouterr().err.strip() == f"raytrain: error: {refused.value}"


@pytest.fixture(scope="module")
def joined(notebook):
    # The block continues the run `trained` made where that ran first (the whole module). The slow tier runs
    # this test alone: the first block's names (`train`, `quick`) without its run, and the block trains the run.
    if "quick" not in notebook.namespace:
        notebook.run(TRAIN, until="run = train(")
    _no_ray_yet()
    try:
        notebook.run(JOIN)
        running = ray.is_initialized()
    finally:
        ray.shutdown()
    return notebook.namespace["again"], running, _ray_left()


@pytest.mark.slow  # one more Ray and Train run (~40 s on 2 busy cores) for the one rule `launcher.ensure_ray` starts with
def test_train_joins_the_callers_ray_and_leaves_it_running(joined, notebook):
    again, running, left = joined
    assert running, "train() stopped the Ray its caller started"
    assert left == (False, [])  # the caller's ray.shutdown() ended it
    assert again.run_dir == (notebook.folder / "runs" / "tiny-dense").resolve() and again.step == 20
    committed = sorted(p for p in (again.run_dir / "checkpoints").glob("step_*") if is_complete(p))
    assert again.checkpoint == committed[-1] and again.checkpoint.name == "step_00000020"


# -------------------------------------------------------------------------------------------- tune


@pytest.fixture(scope="module")
def tuned(notebook):
    _no_ray_yet()
    notebook.run(TUNE)
    return notebook.namespace["experiment"], _ray_left()


def test_tune_returns_the_best_trial_its_reports_and_its_lineage(tuned, notebook):
    experiment, left = tuned
    assert left == (False, []), "tune() left the Ray it started"
    assert experiment.finished and experiment.exp_dir == (notebook.folder / "runs" / "tune" / "pbt-demo").resolve()
    df = experiment.to_dataframe()
    reports = read_reports(experiment.exp_dir)
    spread = [{**{k: v for k, v in r.items() if k != "hparams"}, **r["hparams"]} for r in reports]
    pd.testing.assert_frame_equal(df, pd.DataFrame(spread))  # reports.parquet, hparams a column each
    # one report per (trial, step) on the current branch: 2 trials x steps 10 and 20
    current = df[~df["abandoned"]]
    assert sorted(zip(current["trial"], current["step"])) == sorted(
        (t, s) for t in {t.trial for t in experiment.trials} for s in (10, 20)
    )
    assert len(experiment.trials) == 2
    # the best: the trial whose last report has the lowest val_loss
    last = df.sort_values("time").groupby("trial").tail(1)
    best_row = last.loc[last["metric"].idxmin()]
    best = experiment.best
    assert (best.trial, best.step, best.metric) == (best_row["trial"], 20, best_row["metric"])
    assert best.hparams == {k: best_row[k] for k in ("optimizer.lr", "optimizer.weight_decay")}
    assert best.path == experiment.exp_dir / "runs" / best.trial
    assert best.checkpoint.name == "step_00000020" and is_complete(best.checkpoint)
    assert experiment.get_best_result() is best
    assert len(experiment.get_dataframe()) == 2
    # the lineage: lineage.parquet's rows, as events and as a DataFrame
    events = read_events(experiment.exp_dir)
    assert experiment.lineage == events
    assert pq.read_table(experiment.exp_dir / "lineage.parquet").num_rows == len(events)
    assert len(experiment.lineage_dataframe()) == len(events)
    (exploit,) = events  # synchronous PBT of 2: the worse member exploits the better at step 10
    assert exploit["step"] == 10 and {exploit["trial"], exploit["donor"]} == {t.trial for t in experiment.trials}


def test_tune_exploit_continues_from_the_donor_in_place(tuned):
    """The exploit of the page's experiment (synchronous PBT of two one-worker members, at step 10) is loaded into
    the worse member's live Train run, which trains on from the donor's step-10 weights with the explored
    hyperparameters (the one such check of the default tier: tests/ray/test_pbt.py has the rest of PBT)."""
    experiment, _ = tuned
    exp_dir = experiment.exp_dir
    (event,) = read_events(exp_dir)
    weak, strong = event["trial"], event["donor"]
    assert event["step"] == 10 and event["old_hparams"] != event["donor_hparams"]
    # In place: one Train run per trial, the exploit loaded into the weak trial's live run.
    assert {t: _starts(exp_dir, t) for t in (strong, weak)} == {strong: 1, weak: 1}
    (run,) = (exp_dir / "runs" / weak).glob("live-*")
    (loaded,) = [e for e in read_metrics(run / "metrics.jsonl", "event") if e["event"] == "exploit"]
    assert (loaded["step"], loaded["donor"]) == (10, strong)
    # The loss of step 11 is computed on the weights after step 10: the donor's, not the weak member's own
    # (trained with other hyperparameters, they gave another loss at step 10).
    weak_rows, strong_rows = _train_rows(exp_dir, weak), _train_rows(exp_dir, strong)
    assert weak_rows[10]["loss"] != pytest.approx(strong_rows[10]["loss"], rel=1e-3)  # far from the match below
    assert weak_rows[11]["loss"] == pytest.approx(strong_rows[11]["loss"], rel=1e-6)
    # ... and step 11 ran with the explored learning rate (the same schedule factor as the donor's step 11).
    new_lr, donor_lr = event["new_hparams"]["optimizer.lr"], event["donor_hparams"]["optimizer.lr"]
    assert new_lr != donor_lr
    assert weak_rows[11]["lr"] / strong_rows[11]["lr"] == pytest.approx(new_lr / donor_lr)
    last = {r["trial"]: r for r in sorted(read_reports(exp_dir), key=lambda r: r["time"])}
    assert last[weak]["step"] == 20 and last[weak]["hparams"] == event["new_hparams"]
    # Tune keeps no checkpoint of a trial: the exploit's one record is its lineage row, naming the weak member's
    # own pin of the donor's checkpoint (hard links: nothing copied), whole with the donor's metadata.
    assert not list(exp_dir.glob("TrialRun_*/checkpoint_*"))
    pin = Path(event["pin"])
    assert pin.parent == exp_dir / "runs" / weak / "pins"
    meta = json.loads((pin / "meta.json").read_text())
    assert (meta["trial"], meta["step"]) == (strong, 10) and (pin / meta["step_dir"]).is_dir()


def test_train_without_ray_takes_a_dict_or_a_run_config(corpus_dir, tmp_path, monkeypatch):
    from raytrain_ext import train
    from raytrain_ext.api import run_config
    from tests.conftest import tiny_raw
    from trainers import ConfigError, parse_config

    monkeypatch.chdir(tmp_path)
    raw = tiny_raw(corpus_dir, Path("runs") / "dict", train={"eval_every": 5})
    overrides = {"train.steps": 10, "optimizer.lr": 1e-3}
    assert run_config(parse_config(raw), overrides) == run_config(raw, overrides)
    with pytest.raises(ConfigError, match="--callback is built in Ray's workers"):
        train(raw, overrides=overrides, no_ray=True, callbacks=["tests.ray.hooks:Nothing"])
    run = train(raw, overrides=overrides, no_ray=True, progress=False)
    assert not ray.is_initialized()
    assert run.run_dir == tmp_path.resolve() / "runs" / "dict"  # absolute, though the config's is relative
    assert run.checkpoint == run.run_dir / "checkpoints" / "step_00000010" and is_complete(run.checkpoint)
    steps = [r for r in run.metrics if r["kind"] == "train"]
    evals = [r for r in run.metrics if r["kind"] == "eval"]
    assert (run.step, len(steps), run.world_sizes) == (10, 10, [1])
    assert [r["step"] for r in evals] == [5, 10] and run.val_loss == evals[-1]["val_loss"]
    assert max(r["lr"] for r in steps) <= 1e-3  # the override, not the config's 3e-3


# ------------------------------------------------------------------------------------ the trainer


def test_trainers_public_names_run_a_run_in_this_process(notebook):
    _no_ray_yet()
    notebook.run(ALONE)
    fit, losses = notebook.namespace["fit"], notebook.namespace["losses"]
    assert fit.step == 5 and len(losses.seen) == 5
    rows = read_metrics(notebook.folder / "runs" / "in-process" / "metrics.jsonl", "train")
    assert losses.seen == [r["loss"] for r in rows]
    assert not ray.is_initialized()
