"""Lineage of a population: what each trial reported, and every exploit (with its explore) that happened.

Each trial appends to its own `EXP_DIR/lineage/<trial>.jsonl` (one writer per file: a trial runs in one
actor at a time; in a bucket, which has no append, each append replaces the object whole, so a reader sees
the log before or after it); `collect` merges them into Parquet tables:

- `EXP_DIR/reports.parquet`: time, trial, step, metric, hparams (JSON), failed, steps_s, wall_s, abandoned,
  yielded (the trial gave its Train-run slot to a waiting member after this report: time-sharing),
  running (members holding a slot when it got its own), and where the interval's time outside training
  steps went (`TIME_PARTS`: slot_s, start_s, decision_s, exploit_s, eval_s, checkpoint_s; null in logs
  written before they existed), pin (the report's committed checkpoint), member (the trial's index in the
  population)
- `EXP_DIR/lineage.parquet`: one row per exploit: time, step (where the trial continues: the donor's
  checkpoint step), trial, donor, donor_time (when the donor reported that checkpoint), old_hparams,
  new_hparams, donor_hparams (JSON), score (the trial's last metric), donor_score (the checkpoint's),
  exploit_id (the population's decision), from_step (the trial's own step when it loaded the donor's), pin
  (the trial's own pin of the donor's checkpoint: what it loaded), perturbed (the step the rule counts the
  trial's next decision from: `Population.replay` reads it back)

An exploit is recorded by the trial that restores a checkpoint another trial wrote - the event as it
really happened, whichever scheduler (PBT, PB2) decided it - once per decision, however often Tune
restores the trial from that checkpoint. The functions below are pure over these rows.

A rollback is an exploit of a donor whose checkpoint is behind the trial (`from_step > step`, asynchronous
PBT): the trial trains those steps again from the donor's weights. Its reports past the donor's step from
before the exploit stay in the tables, marked `abandoned` (the branch it left), so that each (trial, step)
has one current report.

The logs are the truth across crashes: each row is written once what it names is committed (a report's
checkpoint pinned, an exploit's donor pin chosen), and names it (`pin`). A trial that starts again (a
`--resume` after its driver was killed, whatever Tune saved last) continues from its log's last row
(`LineageLog.resume_point`): nothing written is cut or trained again, beyond the steps since that row.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from search.times import TIME_PARTS
from trainers.storage import append_bytes, list_sizes, location, read_bytes, write_bytes_atomic

__all__ = [
    "LineageLog",
    "Schedule",
    "collect",
    "read_events",
    "read_reports",
    "schedule_of",
    "best_trial",
    "latest_reports",
]

REPORTS_FILE, EVENTS_FILE = "reports.parquet", "lineage.parquet"


class LineageLog:
    """The rows one trial appends (from the trial function, in its actor)."""

    def __init__(self, exp_dir: Path, trial: str):
        self.trial = trial
        self.path = location(exp_dir) / "lineage" / f"{trial}.jsonl"
        self._content: bytes | None = None  # in a bucket: the log as this writer last left it

    def last_report(self) -> dict[str, Any] | None:
        rows = [r for r in self._rows() if r["kind"] == "report"]
        return rows[-1] if rows else None

    def exploits(self) -> int:
        return sum(r["kind"] == "exploit" for r in self._rows())

    def resume_point(self) -> dict[str, Any] | None:
        """Where a restarted trial continues: its log's newest row that names a whole pin (a report's own, an
        exploit's donor's), as {"step", "pin", "hparams"} (and an exploit's "exploit_id"); {"step", "error"} when
        the trial had failed; None for a log with neither (nothing reported yet, or written before rows named their pins)."""
        for row in reversed(self._rows()):
            if row["kind"] == "report" and row.get("failed"):
                return {"step": row["step"], "error": row.get("error") or "failed before the restart"}
            pin = row.get("pin")
            if pin is None:  # a row from before rows named their pins, or of a restore that copied tensors
                return None
            if read_bytes(location(pin) / "meta.json") is not None:  # else deleted: the row before
                if row["kind"] == "report":
                    return {"step": row["step"], "pin": pin, "hparams": row["hparams"]}
                return {"step": row["step"], "pin": pin, "hparams": row["new_hparams"], "exploit_id": row.get("exploit_id")}
        return None

    def repair(self) -> None:
        """Drop a last line cut by a kill mid-write, before anything is appended after it."""
        data = read_bytes(self.path)
        if data and not data.endswith(b"\n"):
            keep = data[: data.rfind(b"\n") + 1]
            write_bytes_atomic(self.path, keep)
            self._content = None  # read again (a store's: once, by the next append)

    def _rows(self) -> list[dict[str, Any]]:
        if self._content is None:
            return _read_jsonl(self.path)
        return _parse_jsonl(self._content)

    def has_exploit(self, exploit_id: str | None, donor: str, donor_time: float) -> bool:
        """Whether this exploit is recorded already: the same decision (its id), or without an id, the
        same donor checkpoint as the trial's latest exploit."""
        mine = [r for r in self._rows() if r["kind"] == "exploit"]
        if exploit_id is not None:
            return any(r.get("exploit_id") == exploit_id for r in mine)
        return bool(mine) and (mine[-1]["donor"], mine[-1]["donor_time"]) == (donor, donor_time)

    def report(self, step: int, metric: float, hparams: dict[str, Any], **extra: Any) -> None:
        self._append(kind="report", step=step, metric=metric, hparams=hparams, **extra)

    def exploit(
        self,
        step: int,
        donor: str,
        donor_time: float,
        old_hparams: dict[str, Any] | None,
        new_hparams: dict[str, Any],
        donor_hparams: dict[str, Any],
        score: float | None,
        donor_score: float | None,
        exploit_id: str | None = None,
        pin: str | None = None,
        from_step: int | None = None,
        perturbed: int | None = None,
    ) -> bool:
        """Append the exploit unless it is recorded already; returns whether it was appended."""
        if self.has_exploit(exploit_id, donor, donor_time):
            return False
        self._append(
            kind="exploit",
            step=step,
            donor=donor,
            donor_time=donor_time,
            old_hparams=old_hparams,
            new_hparams=new_hparams,
            donor_hparams=donor_hparams,
            score=score,
            donor_score=donor_score,
            exploit_id=exploit_id,
            pin=pin,
            from_step=from_step,
            perturbed=perturbed,
        )
        return True

    def _append(self, **row: Any) -> None:
        row = {"time": time.time(), "trial": self.trial, **row}
        # A store's content as this writer left it (spares a GET per row); None locally: the file is read.
        self._content = append_bytes(self.path, (json.dumps(row) + "\n").encode(), self._content)


def _read_jsonl(path: Any) -> list[dict[str, Any]]:
    data = read_bytes(path)
    return _parse_jsonl(data) if data is not None else []


def _parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    rows = []
    for line in data.decode().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
    return rows


# ------------------------------------------------------------------------------------------ tables

_REPORT_COLUMNS = (
    "time", "trial", "step", "metric", "hparams", "failed", "error", "steps_s", "wall_s", "abandoned",
    "yielded", "running", *TIME_PARTS, "pin", "member", "replica_events",
)
_REPORT_JSON = ("hparams", "replica_events")  # replica_events: a per-step run's groups lost and healed
_EVENT_COLUMNS = (
    "time",
    "step",
    "trial",
    "donor",
    "donor_time",
    "old_hparams",
    "new_hparams",
    "donor_hparams",
    "score",
    "donor_score",
    "exploit_id",
    "from_step",
    "pin",
    "perturbed",
)


def collect(exp_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Merge the trials' logs into `reports.parquet` and `lineage.parquet`; returns (reports, events)."""
    exp_dir = location(exp_dir)
    rows = [r for name in sorted(list_sizes(exp_dir / "lineage", "*.jsonl")) for r in _read_jsonl(exp_dir / "lineage" / name)]
    # Logs written before exploits had ids (or cut by hand) may hold one exploit twice: keep the first.
    unique: dict[Any, dict[str, Any]] = {}
    for r in sorted((r for r in rows if r["kind"] == "exploit"), key=lambda r: r["time"]):
        unique.setdefault(r.get("exploit_id") or (r["trial"], r["donor"], r["donor_time"]), r)
    events = list(unique.values())
    reports = _marked_abandoned(_without_redone([r for r in rows if r["kind"] == "report"], events), events)
    _write(exp_dir / REPORTS_FILE, reports, _REPORT_COLUMNS, json_columns=_REPORT_JSON)
    _write(
        exp_dir / EVENTS_FILE,
        events,
        _EVENT_COLUMNS,
        json_columns=("old_hparams", "new_hparams", "donor_hparams"),
    )
    return read_reports(exp_dir), read_events(exp_dir)


def _without_redone(reports: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A trial that restarts from its own checkpoint (a resumed experiment) may report steps again: the
    later report replaces the earlier ones from that step on. Reports before and after an exploit are
    different lives of the trial and are all kept. One pass per trial: within a life the kept steps only
    rise, so a report replaces a tail of its trial's kept reports."""
    exploit_times = {trial: [e["time"] for e in ex] for trial, ex in _exploits_by_trial(events).items()}
    kept: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for i, r in enumerate(sorted(reports, key=lambda r: r["time"])):
        times = exploit_times.get(r["trial"], [])
        j = bisect.bisect_left(times, r["time"])
        since = times[j - 1] if j else -math.inf
        life = kept.setdefault(r["trial"], [])
        while life and life[-1][1]["time"] > since and life[-1][1]["step"] >= r["step"]:
            life.pop()
        life.append((i, r))
    return [r for _, r in sorted((k for life in kept.values() for k in life), key=lambda k: k[0])]


def _marked_abandoned(reports: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each report with `abandoned`: whether a later exploit of its trial rolled the trial back past it (to
    a donor's checkpoint at an earlier step), leaving the branch it was on."""
    later: dict[str, tuple[list[float], list[float]]] = {}  # trial -> (exploit times, lowest step from each on)
    for trial, exploits in _exploits_by_trial(events).items():
        lowest = list(itertools.accumulate(reversed([e["step"] for e in exploits]), min))[::-1]
        later[trial] = ([e["time"] for e in exploits], lowest)
    marked = []
    for r in reports:
        times, lowest = later.get(r["trial"], ([], []))
        j = bisect.bisect_right(times, r["time"])
        marked.append({**r, "abandoned": j < len(times) and lowest[j] < r["step"]})
    return marked


def _exploits_by_trial(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each trial's exploits, in time order."""
    by_trial: dict[str, list[dict[str, Any]]] = {}
    for e in sorted(events, key=lambda e: e["time"]):
        by_trial.setdefault(e["trial"], []).append(e)
    return by_trial


def _write(
    path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...], json_columns: tuple[str, ...]
) -> None:
    data = {c: [json.dumps(r.get(c)) if c in json_columns else r.get(c) for r in rows] for c in columns}
    types = {
        "step": pa.int64(),
        "from_step": pa.int64(),
        "trial": pa.string(),
        "donor": pa.string(),
        "exploit_id": pa.string(),
        "pin": pa.string(),  # the committed checkpoint a row names (a report's own, an exploit's donor's)
        "member": pa.int64(),  # the trial's index in the population (search.population seeds its draws by it)
        "error": pa.string(),  # why a failed report's run failed
    }
    fields = [pa.field(c, types.get(c, pa.string() if c in json_columns else pa.float64())) for c in columns]
    for flag in ("failed", "abandoned", "yielded"):
        if flag in columns:
            fields[columns.index(flag)] = pa.field(flag, pa.bool_())
            data[flag] = [bool(v) for v in data[flag]]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(data, schema=pa.schema(fields)), sink)
    write_bytes_atomic(path, sink.getvalue().to_pybytes())


def _read(path: Any, json_columns: tuple[str, ...]) -> list[dict[str, Any]]:
    data = read_bytes(path)
    if data is None:
        return []
    # One thread: these tables are small, and Arrow's thread pool, once started, can abort the process at
    # exit (`terminate called without an active exception`, apache/arrow#34314) after a command has printed.
    rows = pq.ParquetFile(pa.BufferReader(data)).read(use_threads=False).to_pylist()
    for r in rows:
        for c in json_columns:
            r[c] = json.loads(r[c]) if r.get(c) is not None else None  # (a column older tables lack: None)
    return rows


def read_reports(exp_dir: Path) -> list[dict[str, Any]]:
    return _read(location(exp_dir) / REPORTS_FILE, _REPORT_JSON)


def read_events(exp_dir: Path) -> list[dict[str, Any]]:
    return _read(location(exp_dir) / EVENTS_FILE, ("old_hparams", "new_hparams", "donor_hparams"))


# ----------------------------------------------------------------------------------------- queries


def latest_reports(reports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each trial's latest report, by trial."""
    last: dict[str, dict[str, Any]] = {}
    for r in sorted(reports, key=lambda r: r["time"]):
        last[r["trial"]] = r
    return last


def best_trial(reports: list[dict[str, Any]], mode: str = "min") -> tuple[str, dict[str, Any]]:
    """The trial whose latest report is the best (finite) one, and that report."""
    last = latest_reports(reports)
    finite = [
        r
        for r in last.values()
        if r["metric"] is not None and r["metric"] == r["metric"] and abs(r["metric"]) != float("inf")
    ]
    if not finite:
        raise ValueError("no trial reported a finite metric")
    pick = min if mode == "min" else max
    best = pick(finite, key=lambda r: r["metric"])
    return best["trial"], best


@dataclass(frozen=True)
class Schedule:
    """The hyperparameters a lineage trained with: `changes[i] = (step, hparams)` holds from `step` on
    (the first at step 0); `path[i] = (trial, from_step, to_step)` says whose steps they were."""

    changes: list[tuple[int, dict[str, Any]]]
    path: list[tuple[str, int, int]]
    final_step: int


def schedule_of(
    trial: str, reports: list[dict[str, Any]], events: list[dict[str, Any]], step: int | None = None
) -> Schedule:
    """Walk back from `trial` at `step` (default: its last report) through the exploits it descends from:
    each exploit at step e hands over the donor's weights trained up to e, so the schedule is the donor's
    up to e, then the trial's own hyperparameters after it."""
    own = sorted((r for r in reports if r["trial"] == trial), key=lambda r: r["time"])
    if step is None:
        if not own:
            raise ValueError(f"trial {trial} reported nothing")
        step = own[-1]["step"]
    path: list[tuple[str, int, int]] = []
    changes: list[tuple[int, dict[str, Any]]] = []
    current, upto, before = trial, step, None
    while True:
        exploit = _last_exploit(current, upto, events, before)
        start = exploit["step"] if exploit else 0
        path.insert(0, (current, start, upto))
        changes.insert(0, (start, _hparams_after(current, start, exploit, reports)))
        if exploit is None:
            break
        current, upto, before = exploit["donor"], exploit["step"], exploit["donor_time"]
    merged: list[tuple[int, dict[str, Any]]] = []
    for s, h in changes:
        if merged and merged[-1][1] == h:
            continue
        merged.append((s, h))
    return Schedule(merged, path, step)


def _last_exploit(
    trial: str, upto: int, events: list[dict[str, Any]], before: float | None
) -> dict[str, Any] | None:
    """The exploit that produced `trial`'s weights at `upto`: its latest one at or before that step (and,
    when following a donor, before the donor reported the checkpoint that was copied)."""
    mine = [
        e
        for e in events
        if e["trial"] == trial and e["step"] <= upto and (before is None or e["time"] < before)
    ]
    return max(mine, key=lambda e: e["time"]) if mine else None


def _hparams_after(
    trial: str, start: int, exploit: dict[str, Any] | None, reports: list[dict[str, Any]]
) -> dict[str, Any]:
    if exploit is not None:
        return exploit["new_hparams"]
    first = [r for r in sorted(reports, key=lambda r: r["time"]) if r["trial"] == trial and r["step"] > start]
    if not first:
        raise ValueError(f"trial {trial} has no report after step {start}")
    return first[0]["hparams"]
