"""`raytrain tune` state across interruptions (issue 12):

- (slow) a `raytrain tune` driver SIGKILLed after an exploit continues with `--resume`; the resumed driver
  interrupted (Ctrl-C) exits 130 with the resume command and no traceback and continues again; the finished
  experiment's lineage holds each report and each exploit once (done-when 3), the population rebuilt from
  it at each resume;
- Ctrl-C before the first report ends the run as interrupted, without a best trial, not with an error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ray import tune

from raytrain_ext.launcher import wait_for
from search.config import load_experiment, save
from search.driver import run_experiment
from tests.ray.test_pbt import _experiment, ray_pbt  # noqa: F401  (the module-scoped local Ray)

pytestmark = pytest.mark.ray


# ---------------------------------------------- a driver killed, resumed, interrupted, resumed (slow)

ROOT = Path(__file__).resolve().parents[2]


def _lines(exp_dir: Path, kind: str) -> list[dict]:
    """The raw lineage rows of one kind (a line cut by a kill mid-write is skipped, as collect does)."""
    rows = []
    for path in sorted((exp_dir / "lineage").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows += [row] if row["kind"] == kind else []
    return rows


class _Driver:
    """`raytrain tune` in its own session (so that what its local Ray started can be ended with it)."""

    def __init__(self, tmp: Path, exp_yaml: Path, *args: str):
        self.out, self.err = tmp / f"out-{id(self)}.txt", tmp / f"err-{id(self)}.txt"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a new local Ray, never another
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "raytrain_ext.cli",
                    "tune",
                    str(exp_yaml),
                    "--address",
                    "local",
                    *args,
                ],
                stdout=out,
                stderr=err,
                cwd=ROOT,
                env={**env, "PYTHONPATH": str(ROOT)},
                start_new_session=True,
            )

    def wait_for(self, predicate, what: str, timeout_s: float = 300) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, (
                f"raytrain tune ended ({self.proc.returncode}): {self.err.read_text()[-3000:]}"
            )
            return predicate()

        wait_for(ready, timeout_s, what, poll_s=0.5)

    def kill(self, sig: int) -> int:
        """Signal the driver (SIGKILL), or its whole group as a terminal's Ctrl-C does (SIGINT); wait for
        it, then end what is left of its session (the local Ray's GCS, raylet and workers)."""
        if sig == signal.SIGINT:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=120)
        self.end()
        return rc

    def end(self) -> None:
        """SIGKILL what is left of the driver's session, by pid: its process group, and the Ray workers that
        the raylet put in groups of their own (they outlived a kill of the group by seconds, and their
        reports landed after the next driver had started)."""
        for pid in _session(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=60)
        wait_for(lambda: not _session(self.proc.pid), 60, f"the processes of session {self.proc.pid} to end")


def _session(sid: int) -> list[int]:
    """Live (not zombie) processes of a session."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def _last_rows(exp_dir: Path) -> dict[str, dict]:
    """Each trial's last lineage row (report or exploit): where it is, by its own log."""
    rows = sorted(_lines(exp_dir, "report") + _lines(exp_dir, "exploit"), key=lambda r: r["time"])
    return {r["trial"]: r for r in rows}


@pytest.mark.slow
def test_a_killed_then_interrupted_driver_resumes_with_each_report_and_exploit_once(corpus_dir, tmp_path):
    """What "each report once" means here. A trial reports every `interval` steps from where it starts: from
    step 0, from the donor's step after an exploit (which may be behind its own: a rollback, whose abandoned
    reports are marked), and after a driver kill from its lineage log's last row, whatever Tune saved last
    (our committed, pinned checkpoints are the truth). So: each life (from a start or an exploit to the
    next) reports each interval once; a resumed trial's next report is its last row's step + interval (no
    reported step trained twice, no progress lost); each (trial, step) has one current report. Each exploit
    once: an exploit applied before a kill stays in the lineage, and its decision is applied once."""
    steps = 50  # a kill after the first exploit, a Ctrl-C after a report: the last before the budget's end
    exp_dir = tmp_path / "runs" / "killed"
    path = _experiment(
        tmp_path,
        corpus_dir,
        "killed",
        {"name": "adamw", "lr": 1e-3},
        {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        budget={"steps": steps},
        # asynchronous: a trial pauses only to be exploited (synchronous PBT restarts every run each interval)
        scheduler={"name": "pbt", "interval": 10, "burn_in": 0, "quantile_fraction": 0.5, "resample_probability": 0.0},
        # The weak member holds after its report of step 10 until the strong one reported step 10 too, so that
        # its next decision has a donor to compare with: on a loaded machine the strong member's run started
        # late enough that the weak one reported every step of the budget first, exploited nobody and the
        # experiment ended before the first kill (seen 2026-11-29, beside another local Ray).
        callbacks=[f"tests.ray.hooks:WaitForReports(exp_dir={str(exp_dir)!r}, lr=0.0001, at=10, on='checkpoint', "
                   "step=10, count=2)"],
    )
    assert load_experiment(path).exp_dir == exp_dir
    drivers: list[_Driver] = []
    try:
        kills = _kill_then_ctrl_c(tmp_path, path, exp_dir, drivers, steps)
    finally:  # a failed wait leaves its driver running
        for driver in drivers:
            driver.end()
    from search.lineage import collect

    reports, events = collect(exp_dir)
    exploits = _lines(exp_dir, "exploit")
    # each exploit once: in the raw logs and in lineage.parquet
    ids = [e["exploit_id"] for e in exploits]
    assert ids and len(set(ids)) == len(ids)
    assert sorted(e["exploit_id"] for e in events) == sorted(ids)
    # the exploit applied before the first kill is in the lineage; nothing written was set aside
    assert kills[0]["exploits"] and set(kills[0]["exploits"]) <= set(ids)
    assert not (exp_dir / "lineage" / "discarded").exists()
    # after the kill and the Ctrl-C, each unfinished trial's next report continues from its log's last row (unless its next
    # row is an exploit that Tune saved before the kill and applies on the restore: its life is checked below)
    for kill in kills:
        for trial, last in kill["last"].items():
            after = sorted(
                (r for r in [*reports, *events] if r["trial"] == trial and r["time"] > kill["time"]), key=_time
            )
            if last["step"] < steps and "donor" not in after[0]:
                assert after[0]["step"] == last["step"] + 10, (trial, last, after[0])
    # each report once: per trial, each life (from its start or an exploit to the next) reports every
    # interval once, and the last life reaches the budget; each (trial, step) has one current report
    for trial in {r["trial"] for r in reports}:
        starts = sorted((e["time"], e["step"]) for e in events if e["trial"] == trial)
        lives = [(float("-inf"), 0), *starts, (float("inf"), None)]
        for (since, first_step), (until, _) in zip(lives, lives[1:]):
            life = sorted(r["step"] for r in reports if r["trial"] == trial and since < r["time"] < until)
            assert life == list(range(first_step + 10, first_step + 10 * (len(life) + 1), 10)), (trial, life)
        assert max(r["step"] for r in reports if r["trial"] == trial and r["time"] > lives[-2][0]) == steps
    current = [(r["trial"], r["step"]) for r in reports if not r["abandoned"]]
    assert len(current) == len(set(current))


def _time(row: dict) -> float:
    return row["time"]


def _kill_then_ctrl_c(tmp_path: Path, path: Path, exp_dir: Path, drivers: list, steps: int) -> list[dict]:
    """Returns, for the kill and the Ctrl-C, when the driver's processes had all ended, each trial's last lineage row then,
    and the exploits logged so far. The Ctrl-C follows a report before the budget's last step: after the last
    one, the experiment may end (exit 0) before the signal lands."""
    kills = []

    def start(*args: str) -> _Driver:
        drivers.append(_Driver(tmp_path, path, "--quiet", *args))
        return drivers[-1]

    def killed() -> None:
        kills.append(
            {
                "time": time.time(),
                "last": _last_rows(exp_dir),
                "exploits": [e["exploit_id"] for e in _lines(exp_dir, "exploit")],
            }
        )

    def reported_since(t: float, before: int = steps + 1) -> bool:
        return any(r["time"] > t and r["step"] < before for r in _lines(exp_dir, "report"))

    # 1. killed once the weak trial has exploited the strong one (Tune may or may not have saved since)
    first = start()
    first.wait_for(lambda: _lines(exp_dir, "exploit"), "a first exploit")
    assert first.kill(signal.SIGKILL) == -signal.SIGKILL
    killed()
    # 2. resumed, Ctrl-C once it reported: one line on how to go on, exit 130, no traceback of the driver's
    # (Ray's actors may log theirs, prefixed with their name)
    second, since = start("--resume"), time.time()
    second.wait_for(lambda: reported_since(since, before=steps), "a report of the resumed run before its last step")
    assert second.kill(signal.SIGINT) == 130
    killed()
    err = second.err.read_text().splitlines()
    assert not [line for line in err if line.startswith("Traceback")], "\n".join(err[-80:])
    assert f"raytrain: interrupted; resume with: raytrain tune {path} --address local --resume" in err
    # 3. resumed (a resumed experiment's resume) to the end
    last = start("--resume")
    assert last.proc.wait(timeout=600) == 0, last.err.read_text()[-3000:]
    assert "done: best trial" in last.out.read_text()
    return kills


# ------------------------------------------------------------------ Ctrl-C before the first report


class InterruptAtFirstStart(tune.Callback):
    def __init__(self):
        self.sent = False

    def on_trial_start(self, iteration, trials, trial, **info):
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)


# the slow tier (~40 s and a local Ray of its own on 2 busy cores): the default tier interrupts an experiment after
# its first reports and resumes it (tests/ray/test_pbt.py); this is the edge before any report
@pytest.mark.slow
def test_ctrl_c_before_the_first_report_is_an_interruption(ray_pbt, corpus_dir, tmp_path):  # noqa: F811
    path = _experiment(
        tmp_path,
        corpus_dir,
        "early",
        {"name": "adamw", "lr": 1e-3},
        {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        # no report can come before the interrupt: the runs hold at their first step (Tune ends them)
        callbacks=["tests.ray.hooks:KillMeAtStep(step=1, rank=0)"],
    )
    exp = load_experiment(path)
    save(exp)
    result = run_experiment(exp, verbose=0, callbacks=[InterruptAtFirstStart()])
    # Tune caught the SIGINT and returned; no trial had reported, so there is no best trial (this was
    # a ValueError from best_trial) and the run is not finished (it printed "done")
    assert not result.finished
    assert (result.best_trial, result.reports) == (None, [])
