"""`raytrain tune report EXP_DIR`: plots and a short summary of a finished (or interrupted) experiment.

Writes `EXP_DIR/report/`: `population.png` (each trial's metric over steps, exploits marked),
`hparams.png` (each hyperparameter's value over steps per trial, the winner's schedule in black),
`lineage.png` (the family tree: who copied whom, when) and `summary.txt` (`--output DIR`: there instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from search.lineage import Schedule, best_trial, collect, schedule_of
from search.state import load_experiment_dir
from search.times import TIME_PARTS
from trainers._base import ConfigError
from trainers.storage import absolute, location, write_folder

__all__ = ["ReportOutput", "format_hparams", "outside_steps_fraction", "write_report"]


@dataclass
class ReportOutput:
    summary: str
    plots: list[Path]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def outside_steps_fraction(reports: list[dict[str, Any]]) -> float | None:
    """Share of the trials' time spent outside training steps (starting runs, restoring, evaluating,
    checkpointing, reporting), over the reports that trained."""
    rows, wall = _trained(reports)
    return 1.0 - sum(r["steps_s"] for r in rows) / wall if wall else None


def _trained(reports: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    """The reports that trained, and their wall time."""
    rows = [r for r in reports if not r["failed"] and _finite(r["wall_s"]) and r["wall_s"] > 0]
    return rows, sum(r["wall_s"] for r in rows)


def time_outside_steps(reports: list[dict[str, Any]]) -> str:
    """The share of the trials' time outside training steps, and where it went (search.times): the parts
    the trials measured, the rest being reporting (Tune's and Ray Train's bookkeeping)."""
    frac = outside_steps_fraction(reports)
    if frac is None:
        return "time outside training steps: n/a"
    rows, wall = _trained(reports)
    parts = {k: sum(r.get(k) or 0.0 for r in rows) / wall for k in TIME_PARTS}
    if not any(parts.values()):  # an experiment logged before the parts existed
        return f"time outside training steps: {frac:.1%} of trial time"
    rest = max(frac - sum(parts.values()), 0.0)
    largest_first = sorted(parts.items(), key=lambda kv: -kv[1])
    named = [f"{TIME_PARTS[k]} {v:.1%}" for k, v in largest_first if v >= 0.0005]
    return f"time outside training steps: {frac:.1%} of trial time: " + ", ".join([*named, f"reporting {rest:.1%}"])


def turns(exp: Any, reports: list[dict[str, Any]]) -> str | None:
    """How the population shared the cluster: members at once, and how often each yielded its slot."""
    running = [r["running"] for r in reports if _finite(r.get("running"))]
    if not running:
        return None
    per_trial = {t: sum(bool(r.get("yielded")) for r in reports if r["trial"] == t) for t in {r["trial"] for r in reports}}
    mean = sum(per_trial.values()) / len(per_trial)
    return (
        f"time-sharing: at most {int(max(running))} of {exp.population} members ran at once; each yielded its "
        f"slot {mean:.1f} times on average (min {min(per_trial.values())}, max {max(per_trial.values())})"
    )


def replica_groups(reports: list[dict[str, Any]]) -> str | None:
    """Per-step fault tolerance: each trial's replica groups lost and healed, as its reports logged them."""
    told = [f"{r['trial']} {line}" for r in reports for line in r.get("replica_events") or ()]
    return "replica groups lost and healed:\n" + "\n".join(f"  {line}" for line in told) if told else None


def write_report(exp_dir: Path, output: Path | None = None) -> ReportOutput:
    """Summary and plots into `output` (default EXP_DIR/report; for an experiment in a bucket, drawn here
    and uploaded there)."""
    import matplotlib

    matplotlib.use("Agg")
    exp_dir = absolute(exp_dir)
    exp = load_experiment_dir(exp_dir)
    reports, events = collect(exp_dir)
    if not reports:
        raise ConfigError(f"{exp_dir}: no trial has reported yet; fix: run `raytrain tune` first")
    target = location(output) if output is not None else exp_dir / "report"
    with write_folder(target, last="summary.txt") as out:  # a bucket's: drawn here, uploaded there
        out.mkdir(parents=True, exist_ok=True)
        trials = sorted({r["trial"] for r in reports})
        winner, row = best_trial(reports, exp.mode)
        schedule = schedule_of(winner, reports, events)
        plots = [
            _plot_population(out / "population.png", reports, events, trials, exp.metric, winner),
            _plot_hparams(out / "hparams.png", reports, events, trials, list(exp.search_space.mutable), schedule),
            _plot_lineage(out / "lineage.png", reports, events, trials, winner),
        ]
        summary = _summary(exp, reports, events, trials, winner, row, schedule)
        (out / "summary.txt").write_text(summary + "\n")
    return ReportOutput(summary, [target / p.name for p in plots])


# ----------------------------------------------------------------------------------------- plots


def _by_trial(reports: list[dict[str, Any]], trial: str) -> list[dict[str, Any]]:
    return sorted((r for r in reports if r["trial"] == trial), key=lambda r: r["time"])


@dataclass
class _Life:
    """A trial from its start, or from an exploit, to its next exploit."""

    start: int
    start_metric: float | None  # the donor's metric at the exploit
    hparams: dict[str, Any]
    rows: list[dict[str, Any]]


def _lives(trial: str, reports: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[_Life]:
    rows = _by_trial(reports, trial)
    mine = sorted((e for e in events if e["trial"] == trial), key=lambda e: e["time"])
    bounds = [None, *mine]
    lives = []
    for i, e in enumerate(bounds):
        lo = e["time"] if e else -math.inf
        hi = bounds[i + 1]["time"] if i + 1 < len(bounds) else math.inf
        part = [r for r in rows if lo < r["time"] < hi]
        if e is None and not part:
            continue
        hparams = e["new_hparams"] if e else part[0]["hparams"]
        lives.append(_Life(e["step"] if e else 0, e["donor_score"] if e else None, hparams, part))
    return lives


def _plot_population(path, reports, events, trials, metric, winner) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, trial in enumerate(trials):
        for k, life in enumerate(_lives(trial, reports, events)):
            start = [(life.start, life.start_metric)] if life.start_metric is not None else []
            keep = [(x, y) for x, y in start + [(r["step"], r["metric"]) for r in life.rows] if _finite(y)]
            label = (trial + (" (best)" if trial == winner else "")) if k == 0 else None
            ax.plot([x for x, _ in keep], [y for _, y in keep], marker=".", color=f"C{i % 10}",
                    lw=2.5 if trial == winner else 1.2, label=label)
            if life.start_metric is not None:  # the exploit: the trial continues from the donor's point
                ax.plot([life.start], [life.start_metric], marker="o", mfc="none", color=f"C{i % 10}", ms=9)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"population: {metric} per trial (o = continues from a donor after an exploit)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_hparams(path, reports, events, trials, keys, schedule: Schedule) -> Path:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        steps = [s for s, _ in schedule.changes] + [schedule.final_step]
        for (start, h), end in zip(schedule.changes, steps[1:]):
            ax.plot([start, end], [h.get(key)] * 2, color="black", lw=4, alpha=0.35)
        for i, trial in enumerate(trials):
            for k, life in enumerate(_lives(trial, reports, events)):
                end = max([r["step"] for r in life.rows], default=life.start)
                ax.plot([life.start, end], [life.hparams.get(key)] * 2, color=f"C{i % 10}", lw=1.5,
                        label=trial if k == 0 else None)
                if life.start_metric is not None:
                    ax.plot([life.start], [life.hparams.get(key)], marker="o", mfc="none", color=f"C{i % 10}")
        ax.set_ylabel(key)
        values = [r["hparams"].get(key) for r in reports]
        if key.endswith("lr") and all(isinstance(v, (int, float)) and v > 0 for v in values):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("hyperparameters per trial (o = explored at an exploit); grey: the best trial's "
                         "schedule")
    axes[0, 0].legend(fontsize=7)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_lineage(path, reports, events, trials, winner) -> Path:
    import matplotlib.pyplot as plt

    y = {t: i for i, t in enumerate(trials)}
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(trials) + 1.8))
    for trial in trials:
        rows = _by_trial(reports, trial)
        starts = [0] + [e["step"] for e in sorted(events, key=lambda e: e["time"]) if e["trial"] == trial]
        for s in starts:  # each life of the trial: from its start (or an exploit) to its next report run
            after = [r["step"] for r in rows if r["step"] > s]
            if after:
                color = "C0" if trial != winner else "C3"
                ax.plot([s, max(after)], [y[trial]] * 2, color=color, lw=3, alpha=0.5)
    arrow = {"arrowstyle": "->", "color": "black", "lw": 1, "connectionstyle": "arc3,rad=0.2"}
    for e in events:
        ax.annotate("", xy=(e["step"], y[e["trial"]]), xytext=(e["step"], y[e["donor"]]), arrowprops=arrow)
    ax.set_yticks(range(len(trials)), trials, fontsize=7)
    ax.set_xlabel("step")
    ax.set_title("family tree: arrows go from donor to the trial that copied its weights")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------- summary


def format_hparams(hparams: dict[str, Any]) -> str:
    """`lr=0.001, wd=0.1`: sorted by key, floats to four significant digits."""
    pairs = sorted(hparams.items())
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in pairs)


def _summary(exp, reports, events, trials, winner, row, schedule: Schedule) -> str:
    lines = [
        f"experiment {exp.name}: {exp.scheduler.name}, population {exp.population}, {exp.steps} steps per trial, "
        f"interval {exp.scheduler.interval}, {exp.resources.workers} workers per trial ({exp.trial_runs} runs)",
        f"best: {winner}, {exp.metric} {row['metric']:.4f} at step {row['step']}",
        f"exploits: {len(events)}; failed reports: {sum(bool(r['failed']) for r in reports)}",
        time_outside_steps(reports),
        *filter(None, [turns(exp, reports), replica_groups(reports)]),
        "winning schedule (replay with `raytrain tune replay`):",
        *(f"  from step {s}: {format_hparams(h)}" for s, h in schedule.changes),
        "  lineage: " + " -> ".join(f"{t}[{a}..{b}]" for t, a, b in schedule.path),
        "final per trial:",
    ]
    for trial in trials:
        last = _by_trial(reports, trial)[-1]
        hparams = format_hparams(last["hparams"])
        lines.append(f"  {trial}: step {last['step']}, {exp.metric} {last['metric']:.4f}, {hparams}")
    return "\n".join(lines)
