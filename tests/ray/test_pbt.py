"""PBT over Ray Train runs (CPU, 1 worker per trial, 2 trials, synchronous PBT so that the weaker trial
exploits the stronger one at the first interval, deterministically):

- an exploit continues from the donor in place (the weaker member's first loss after the exploit is the donor's,
  in its live Train run, with the explored learning rate): tests/ray/test_api.py's experiment (the Python API's,
  the same population of two) in the default tier; here, in synchronous and asynchronous PBT (a rollback), PB2
  and random search, and a worker killed right after an in-place exploit resumes the exploited state (that
  experiment tracked with MLflow: a parent run, a child run per trial with each step once, the exploit a tag);
- a trial whose loss goes NaN is replaced through exploit and finishes with the population;
- a driver interrupted (SIGINT) after an exploit resumes with `--resume` semantics: the exploited trial
  continues from the donor's checkpoint with its new hyperparameters, the scheduler's count of exploits
  carries over, and report/replay work on the result.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import yaml
from ray import tune

from search.config import load_experiment, save
from search.driver import run_experiment
from search.lineage import read_events, read_reports
from tests.conftest import tiny_raw
from tests.ray.conftest import RUNTIME_ENV, local_ray
from trainers.metrics import read_metrics
from trainers.storage import location

pytestmark = pytest.mark.ray

INTERVAL, STEPS = 10, 20


@pytest.fixture(scope="module")
def ray_pbt():
    with local_ray(RUNTIME_ENV) as ray:
        yield ray


def _experiment(
    tmp: Path, corpus: Path, name: str, optimizer: dict, space: dict, initial: list[dict], **more
) -> Path:
    base = tiny_raw(corpus, tmp / "unused", optimizer=optimizer, train={"tensorboard": False})
    (tmp / f"{name}-base.yaml").write_text(yaml.safe_dump(base))
    exp = {
        "name": name,
        "base": f"{name}-base.yaml",
        "space": space,
        "initial": initial,
        "scheduler": {
            "name": "pbt",
            "interval": INTERVAL,
            "burn_in": 0,  # decisions from the first report on (the default waits for half the budget)
            "quantile_fraction": 0.5,
            "synch": True,
            "resample_probability": 0.0,
        },
        "population": 2,
        "budget": {"steps": STEPS},
        "resources": {"workers": 1},
        "storage": str(tmp / "runs"),
        **more,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def _train_rows(exp_dir: Path, trial: str) -> dict[int, dict]:
    """Each step of a trial's Train runs, from the run that trained it last."""
    rows = []
    for path in (exp_dir / "runs" / trial).glob("*/metrics.jsonl"):
        rows += read_metrics(path, "train")
    return {r["step"]: r for r in sorted(rows, key=lambda r: r["time"])}


def _starts(exp_dir: Path, trial: str) -> int:
    """Train-run starts of a trial: the `start`/`resume` events of all its runs (an exploit in place is an
    `exploit` event of the live run)."""
    events = [e for p in (exp_dir / "runs" / trial).glob("*/metrics.jsonl") for e in read_metrics(p, "event")]
    return sum(e["event"] in ("start", "resume") for e in events)


def _trial_of(exp_dir: Path, lr: float) -> str:
    return next(r["trial"] for r in read_reports(exp_dir) if r["hparams"]["optimizer.lr"] == lr)


# ------------------------------------------------------------------ NaN trial, interrupt, resume


class InterruptAfterExploit(tune.Callback):
    """Sends the driver a SIGINT (as Ctrl-C would) once the exploited trial holds at its first step from the
    donor (`hooks.HoldOnceFromDonor` marks it): after the exploit and before that trial finishes, however
    slow the machine (an interrupt sent at the exploit itself could land before the run started, and the
    resumed run would then hold with nobody to stop it)."""

    def __init__(self, exp_dir: Path):
        self.exp_dir, self.sent = str(exp_dir), False  # a local folder or a bucket's URI

    def get_state(self):  # the resumed experiment restores its callbacks: do not interrupt it again
        return {"sent": self.sent}

    def set_state(self, state):
        self.sent = state["sent"]

    def on_step_end(self, iteration, trials, **info):
        if not self.sent and (location(self.exp_dir) / "held-once").exists():
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


def _end_held_worker(exp_dir: Path) -> None:
    """The worker `HoldOnceFromDonor` held (its pid in the marker), if the interrupted experiment's end left it
    holding: it would wait out the hold's timeout (180 s) with its run's CPUs, and the experiments after this
    one (the module shares one Ray) would wait for them."""
    try:
        os.kill(int((location(exp_dir) / "held-once").read_text()), signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass


@pytest.fixture(scope="module")
def nan_resumed(ray_pbt, corpus_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pbt-nan")
    # SGD at lr 1e6 without clipping: the loss is NaN within a few steps and the run stops (max_bad_steps)
    path = _experiment(
        tmp,
        corpus_dir,
        "nan",
        {"name": "sgd", "lr": 0.5, "grad_clip": None, "weight_decay": 0.0},
        {"optimizer.lr": {"loguniform": [1e-3, 1e6]}},
        [{"optimizer.lr": 0.5}, {"optimizer.lr": 1e6}],
        # the replaced member holds at its first step from the donor (it would otherwise finish within
        # seconds): the interrupt lands before it finishes, and Tune ends the held run
        callbacks=["tests.ray.hooks:HoldOnceFromDonor()"],
    )
    exp = load_experiment(path)
    save(exp)
    first = run_experiment(exp, verbose=0, callbacks=[InterruptAfterExploit(exp.exp_dir)])
    _end_held_worker(exp.exp_dir)
    before = {"reports": list(first.reports), "events": list(first.events), "finished": first.finished}
    resumed = run_experiment(exp, resume=True, verbose=0)
    return exp, before, resumed


def test_nan_trial_is_replaced_through_exploit(nan_resumed):
    exp, _, result = nan_resumed
    good, bad = _trial_of(exp.exp_dir, 0.5), _trial_of(exp.exp_dir, 1e6)
    bad_reports = [r for r in result.reports if r["trial"] == bad]
    assert (
        bad_reports[0]["failed"]
        and math.isinf(bad_reports[0]["metric"])
        and bad_reports[0]["step"] == INTERVAL
    )
    assert "NonFiniteLossError" in json.dumps(
        [json.loads(line) for line in (exp.exp_dir / "lineage" / f"{bad}.jsonl").read_text().splitlines()]
    )
    (event,) = [e for e in result.events if e["trial"] == bad]
    assert (event["donor"], event["step"]) == (good, INTERVAL)
    assert math.isinf(event["score"]) and math.isfinite(event["donor_score"])
    # replaced, not dropped: it trained on from the donor and finished the budget with a finite loss
    assert bad_reports[-1]["step"] == STEPS and not bad_reports[-1]["failed"]
    assert math.isfinite(bad_reports[-1]["metric"])
    assert bad_reports[-1]["hparams"]["optimizer.lr"] in (pytest.approx(0.5 * 2), pytest.approx(0.5 * 0.5))


def test_interrupted_driver_resumes_with_the_population_from_the_lineage(nan_resumed):
    exp, before, result = nan_resumed
    bad = _trial_of(exp.exp_dir, 1e6)
    # The interrupt came after the exploit, before the exploited trial finished: Tune returned as from a
    # finished run, the driver tells it apart (`raytrain tune` exits 130 then).
    assert not before["finished"] and result.finished
    assert [e["trial"] for e in before["events"]] == [bad]
    assert not [r for r in before["reports"] if r["trial"] == bad and r["step"] == STEPS]
    # After --resume: the same two trials, each at the end of the budget; the exploited one trained on
    # from the donor's checkpoint (its step-20 loss is finite) with the explored learning rate.
    last = {r["trial"]: r for r in sorted(result.reports, key=lambda r: r["time"])}
    assert len(last) == 2 and {r["step"] for r in last.values()} == {STEPS}
    assert last[bad]["hparams"] != {"optimizer.lr": 1e6} and not last[bad]["failed"]
    # The exploit once in the record: the trial's log (the population resumed from it decided no other).
    rows = [json.loads(line) for line in (exp.exp_dir / "lineage" / f"{bad}.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows].count("exploit") == len(read_events(exp.exp_dir)) == 1


def test_report_and_replay_on_the_result(nan_resumed, ray_pbt):
    from search.replay import replay
    from search.report import write_report

    exp, _, result = nan_resumed
    out = write_report(exp.exp_dir)
    assert [p.name for p in out.plots] == ["population.png", "hparams.png", "lineage.png"]
    assert all(p.stat().st_size > 10_000 for p in out.plots)
    assert "exploits: 1" in out.summary and f"best: {result.best_trial}" in out.summary

    bad = _trial_of(exp.exp_dir, 1e6)
    rep = replay(exp.exp_dir, bad)
    # The schedule of the replaced trial is the donor's until step 10, then its explored learning rate;
    # replayed from scratch as one run it lands on the loss the trial reported (CPU runs are deterministic).
    assert [s for s, _ in rep.schedule.changes] == [0, INTERVAL]
    assert rep.schedule.changes[0][1] == {"optimizer.lr": 0.5}
    assert rep.replayed == pytest.approx(rep.reported, rel=1e-5)


# ------------------------------------------------------------------------------- in place, more


class KillPidFiles(tune.Callback):
    """Driver side of tests.ray.hooks' Kill* callbacks: SIGKILLs each process that wrote its pid file."""

    def __init__(self, exp_dir: Path):
        self.exp_dir, self.killed = exp_dir, set()

    def on_step_end(self, iteration, trials, **info):
        for pid_file in self.exp_dir.glob("runs/*/*/pids/rank*"):
            if pid_file not in self.killed and pid_file.read_text():
                self.killed.add(pid_file)
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def lr_experiment(tmp: Path, corpus: Path, name: str, lrs=(1e-2, 1e-4), **more) -> Path:
    """An experiment over AdamW's learning rate in [1e-4, 1e-2], one member per value of `lrs`."""
    space = {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}}
    initial = [{"optimizer.lr": lr} for lr in lrs]
    return _experiment(tmp, corpus, name, {"name": "adamw", "lr": 1e-3}, space, initial, **more)


def _run(tmp: Path, corpus: Path, name: str, scheduler: dict, steps: int = STEPS, **more):
    path = lr_experiment(tmp, corpus, name, **more)
    raw = yaml.safe_load(path.read_text())
    raw["scheduler"] = {**raw["scheduler"], **scheduler}
    raw["budget"] = {"steps": steps}
    if scheduler.get("name") in ("pb2", "random"):
        raw["scheduler"] = {"name": scheduler["name"], "interval": INTERVAL}
    path.write_text(yaml.safe_dump(raw))
    exp = load_experiment(path)
    save(exp)
    return run_experiment(exp, verbose=0, callbacks=[KillPidFiles(exp.exp_dir)])


@pytest.mark.slow  # ~90 s on 2 cores; the default tier has the synchronous experiment and the unit tests
def test_an_exploit_of_a_donor_behind_rolls_back_once_with_one_current_report_per_step(
    ray_pbt, corpus_dir, tmp_path
):
    """Asynchronous PBT, the donor behind: the strong member holds after step 1 until the weak one reported
    step 10 (the weak's first decision has no score to compare: go on), and after step 11 until the weak
    reported step 20, which its decision then compares with the strong's step 10: the weak exploits the
    strong's step-10 checkpoint and trains 11..20 again (a rollback). The weak holds after step 11 until
    both reported step 10. Its second report of step 20 needs a new decision: the old answer at step 20 (the
    exploit) loaded the same exploit again, and again."""
    exp_dir = tmp_path / "runs" / "rollback"
    # A hold that waits for the member's own report goes after that report (on="checkpoint"): with async
    # saves the report of step 10 comes at its commit, a step or more later, not before step 11.
    hold = "tests.ray.hooks:WaitForReports(exp_dir={!r}, lr={}, at={}, on={!r}, step={}, count={})"
    callbacks = [
        hold.format(str(exp_dir), 0.01, 1, "step", 10, 1),
        hold.format(str(exp_dir), 0.01, 10, "checkpoint", 20, 1),
        hold.format(str(exp_dir), 0.0001, 10, "checkpoint", 10, 2),
    ]
    result = _run(tmp_path, corpus_dir, "rollback", {"synch": False}, steps=3 * INTERVAL, callbacks=callbacks)
    strong, weak = _trial_of(exp_dir, 1e-2), _trial_of(exp_dir, 1e-4)
    mine = sorted((e for e in result.events if e["trial"] == weak), key=lambda e: e["time"])
    first = mine[0]
    assert (first["donor"], first["step"], first["from_step"]) == (strong, INTERVAL, 2 * INTERVAL), "a rollback"
    # each exploit applied once: one `exploit` event in the live run per exploit in the lineage
    (run,) = (exp_dir / "runs" / weak).glob("live-*")
    loaded = [e for e in read_metrics(run / "metrics.jsonl", "event") if e["event"] == "exploit"]
    assert len(loaded) == len(mine) and len({e["exploit_id"] for e in mine}) == len(mine)
    assert {t: _starts(exp_dir, t) for t in (strong, weak)} == {strong: 1, weak: 1}, "exploits in place"
    # step 11 is computed on the donor's step-10 weights (bit for bit) with the explored learning rate
    weak_rows, strong_rows = _train_rows(exp_dir, weak), _train_rows(exp_dir, strong)
    latest = max((e for e in mine if e["step"] == INTERVAL), key=lambda e: e["time"])
    assert weak_rows[INTERVAL + 1]["loss"] == strong_rows[INTERVAL + 1]["loss"]
    new_lr = latest["new_hparams"]["optimizer.lr"]
    assert weak_rows[INTERVAL + 1]["lr"] / strong_rows[INTERVAL + 1]["lr"] == pytest.approx(new_lr / 1e-2)
    # the abandoned branch's report is marked (a later decision may roll back again: one mark each); each
    # (trial, step) has one current report
    abandoned = [(r["trial"], r["step"], r["time"] < first["time"]) for r in result.reports if r["abandoned"]]
    assert (weak, 2 * INTERVAL, True) in abandoned
    current = [(r["trial"], r["step"]) for r in result.reports if not r["abandoned"]]
    assert sorted(current) == sorted((t, s) for t in (strong, weak) for s in (10, 20, 30))
    assert read_reports(exp_dir) == result.reports


@pytest.fixture(scope="module")
def killed(ray_pbt, corpus_dir, tmp_path_factory):
    """Synchronous PBT of two members tracked with MLflow (a local store in the experiment folder), the
    exploited member's worker SIGKILLed at its first step from the donor and its group restarted."""
    tmp = tmp_path_factory.mktemp("killed")
    tracking = {"mlflow": {"experiment": "pbt-tracked"}, "flush_every_s": 0.5}
    return _run(
        tmp,
        corpus_dir,
        "killed",
        {},
        keep_checkpoints=1,
        overrides={"scaling.max_failures": 1, "tracking": tracking},
        callbacks=["tests.ray.hooks:KillMeAfterExploit(rank=0)"],
    )


@pytest.mark.slow  # ~2 min on 2 cores
def test_a_worker_killed_right_after_an_exploit_resumes_the_exploited_state(killed):
    result = killed
    exp_dir = result.exp_dir
    strong, weak = _trial_of(exp_dir, 1e-2), _trial_of(exp_dir, 1e-4)
    (run,) = (exp_dir / "runs" / weak).glob("live-*")
    assert (run / "pids" / "rank0").exists(), "the worker was killed after the exploit"
    events = [e["event"] for e in read_metrics(run / "metrics.jsonl", "event") if e["event"] != "checkpoint"]
    assert events == ["start", "exploit", "resume"]
    (exploit,) = [e for e in read_metrics(run / "metrics.jsonl", "event") if e["event"] == "exploit"]
    (resume,) = [e for e in read_metrics(run / "metrics.jsonl", "event") if e["event"] == "resume"]
    # the restarted group asked the run's gate: no commit since the exploit, so the exploit's checkpoint (the
    # trial's pin of the donor's), not the run's newest commit (its own step 10, of the branch it left)
    assert resume["checkpoint"] == exploit["checkpoint"] and "/pins/" in resume["checkpoint"]
    # Resumed from the donor's checkpoint with the explored rate: step 11 is the donor's loss
    # (the weak trial's own step-10 weights give a loss > 0.5 higher, see the test above).
    weak_rows, strong_rows = _train_rows(exp_dir, weak), _train_rows(exp_dir, strong)
    after = INTERVAL + 1
    assert weak_rows[after]["loss"] == strong_rows[after]["loss"]
    new_lr = [e for e in result.events if e["trial"] == weak][0]["new_hparams"]["optimizer.lr"]
    assert weak_rows[after]["lr"] / strong_rows[after]["lr"] == pytest.approx(new_lr / 1e-2)
    assert sorted(weak_rows) == list(range(1, STEPS + 1)), "each step once"


@pytest.mark.slow  # the experiment above
def test_trials_are_child_runs_of_the_experiments_run(killed):
    """MLflow: one parent run for the experiment, each trial a child run holding every step once across its
    Train runs and the killed worker's restart, the exploit as a tag of the exploited trial."""
    from mlflow import MlflowClient

    exp_dir = killed.exp_dir
    state = json.loads((exp_dir / "mlflow" / "parent.json").read_text())
    assert state["tracking_uri"] == f"sqlite:///{exp_dir.resolve() / 'mlflow' / 'mlflow.db'}"
    client = MlflowClient(state["tracking_uri"])
    parent = client.get_run(state["parent_run_id"])
    assert (parent.info.run_name, parent.info.status) == ("killed", "FINISHED")
    assert client.get_experiment(parent.info.experiment_id).name == "pbt-tracked"
    assert parent.data.params["population"] == "2" and parent.data.params["scheduler.name"] == "pbt"
    assert parent.data.tags["best_trial"] == killed.best_trial

    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    trials = sorted({r["trial"] for r in read_reports(exp_dir)})
    assert sorted(c.info.run_name for c in children) == trials, "one child per trial"
    for child in children:
        trial = child.info.run_name
        assert child.info.status == "FINISHED" and child.data.tags["raytrain.trial"] == trial
        history = client.get_metric_history(child.info.run_id, "loss")
        assert [m.step for m in history] == list(range(1, STEPS + 1)), "each step once, over its Train runs"
        rows = _train_rows(exp_dir, trial)
        assert [m.value for m in history] == pytest.approx([rows[s]["loss"] for s in range(1, STEPS + 1)])
        assert child.data.params["optimizer.name"] == "adamw"

    (exploit,) = read_events(exp_dir)
    weak = next(c for c in children if c.info.run_name == exploit["trial"])
    tag = weak.data.tags[f"exploit.{exploit['step']:08d}"]
    new_lr = exploit["new_hparams"]["optimizer.lr"]
    assert tag.startswith(f"from {exploit['donor']} (val_loss ") and f"-> {new_lr:.4g}" in tag
    assert weak.data.tags["changed.optimizer.lr"] == str(new_lr), "the explored value, next to the first"
    strong = next(c for c in children if c.info.run_name == exploit["donor"])
    assert not any(k.startswith("exploit.") for k in strong.data.tags)


@pytest.mark.slow  # ~40 s on 2 cores
def test_a_trial_whose_run_fails_is_named_in_the_result(ray_pbt, corpus_dir, tmp_path):
    """Random search, one member's run raising at its step 2 (every attempt): that trial reports the failure
    and ends, the other reaches the budget in one Train run; the result names the failed trial (`raytrain
    tune` exits 1)."""
    result = _run(tmp_path, corpus_dir, "failing", {"name": "random"}, steps=INTERVAL,
                  callbacks=["tests.ray.hooks:RaiseAtStep(step=2, lr=0.0001)"])
    strong, weak = _trial_of(result.exp_dir, 1e-2), _trial_of(result.exp_dir, 1e-4)
    assert result.finished and result.failed == [weak] and result.best_trial == strong
    (failed,) = [r for r in result.reports if r["trial"] == weak]
    assert failed["failed"] and "injected failure at step 2" in failed["error"]
    assert [r["step"] for r in result.reports if r["trial"] == strong and not r["abandoned"]] == [INTERVAL]
    assert _starts(result.exp_dir, strong) == 1


@pytest.mark.slow  # ~60 s on 2 cores
def test_a_callbacks_own_eval_metric_ranks_the_population_with_mode_max(ray_pbt, corpus_dir, tmp_path):
    """PB2, `metric: eval/accuracy, mode: max`: the value a callback adds to each eval record reaches the
    trials' reports, the scheduler and the result; the best trial is the one with the highest accuracy
    reported; PB2's exploits are in place too (one Train run per trial)."""
    path = lr_experiment(
        tmp_path, corpus_dir, "accuracy", metric="eval/accuracy", mode="max",
        callbacks=["tests.ray.hooks:EvalAccuracy"], scheduler={"name": "pb2", "interval": INTERVAL},
    )
    exp = load_experiment(path)
    save(exp)
    result = run_experiment(exp, verbose=0)
    reports = read_reports(Path(result.exp_dir))
    assert result.finished and len({r["trial"] for r in reports}) == 2
    final = {r["trial"]: r["metric"] for r in reports if r["step"] == STEPS and not r["abandoned"]}
    assert all(0 < m < 1 for m in final.values()), final  # accuracies, not losses
    assert result.best_trial == max(final, key=final.get) and result.best_metric == max(final.values())
    # each report's metric is the eval row's accuracy of its run at that step
    for r in (r for r in reports if not r["abandoned"] and r["step"] == STEPS):
        evals = [e for p in (Path(result.exp_dir) / "runs" / r["trial"]).glob("*/metrics.jsonl")
                 for e in read_metrics(p, "eval") if e["step"] == STEPS]
        assert evals and evals[-1]["accuracy"] == pytest.approx(r["metric"], rel=1e-12)
    assert {t: _starts(result.exp_dir, t) for t in final} == dict.fromkeys(final, 1)
