"""`raytrain report RUN_DIR`: plots of a run's `metrics.jsonl` and a one-page `summary.md`.

RUN_DIR may also be a folder of run folders, read as one run in time order: a Tune trial's folder
(`EXP_DIR/runs/<trial>/`) holds one Train run per life of the trial, each resumed from a checkpoint.
Writes `RUN_DIR/report/` (or `--out`): one PNG per panel (`_PANELS`), `overview.png` with every panel, and
`summary.md`. Resizes (red) and resumes (grey) are marked on every panel at their step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from trainers._base import ConfigError
from trainers.metrics import read_metrics
from trainers.run_dir import METRICS, RunDir

__all__ = ["RunReport", "write_run_report"]

_GIB = 2**30


@dataclass
class RunReport:
    summary_path: Path
    plots: list[Path]


@dataclass
class _Run:
    name: str
    config: dict[str, Any]
    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    events: list[dict[str, Any]]
    attempts: int  # run folders read (a Tune trial's Train runs; 1 for a run folder)

    def series(self, key: str, rows: list[dict[str, Any]] | None = None) -> tuple[list[float], list[float]]:
        """(steps, values) of `key` in the train records (or `rows`); a gap in the train steps (a trial
        that continued from another's checkpoint) breaks the line."""
        pts = [(r["step"], r[key]) for r in (self.train if rows is None else rows) if _finite(r.get(key))]
        steps: list[float] = []
        values: list[float] = []
        for step, value in pts:
            if rows is None and steps and step > steps[-1] + 1:
                steps.append(math.nan)
                values.append(math.nan)
            steps.append(step)
            values.append(float(value))
        return steps, values


def write_run_report(run_dir: Path, out: Path | None = None) -> RunReport:
    import matplotlib

    matplotlib.use("Agg")
    run = _read_run(Path(run_dir))
    out = Path(out) if out is not None else Path(RunDir(run_dir).report)
    out.mkdir(parents=True, exist_ok=True)
    panels = [p for p in _PANELS if p.needs is None or run.series(p.needs)[0]]
    plots = [_save(out / f"{p.name}.png", [p], run) for p in panels]
    plots.append(_save(out / "overview.png", panels, run, overview=True))
    summary = out / "summary.md"
    summary.write_text(_summary(run, Path(run_dir), plots))
    return RunReport(summary, plots)


def _read_run(run_dir: Path) -> _Run:
    """A run folder, or a folder of run folders taken as one run in time order (a Tune trial's Train
    runs: each continues from a checkpoint; for a step trained twice, the later record is kept)."""
    runs = [run_dir] if RunDir(run_dir).metrics.is_file() else _run_folders(run_dir)
    rows = sorted(
        (r for d in runs for r in read_metrics(RunDir(d).metrics)), key=lambda r: r.get("time", 0)
    )
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r.get("kind") in ("train", "eval"):
            latest[(r["kind"], r["step"])] = r
    train = sorted((r for (kind, _), r in latest.items() if kind == "train"), key=lambda r: r["step"])
    if not train:
        raise ConfigError(
            f"{run_dir}: no training steps in metrics.jsonl; fix: pass a run folder that has trained "
            f"(raytrain train writes RUN_DIR/metrics.jsonl), or a folder of such run folders"
        )
    config_file = RunDir(runs[-1]).config
    config = (yaml.safe_load(config_file.read_text()) if config_file.is_file() else None) or {}
    evals = sorted((r for (kind, _), r in latest.items() if kind == "eval"), key=lambda r: r["step"])
    events = [r for r in rows if r.get("kind") == "event"]
    name = config.get("name") if len(runs) == 1 else run_dir.name
    return _Run(name or run_dir.name, config, train, evals, events, len(runs))


def _run_folders(folder: Path) -> list[Path]:
    """Sub-folders holding a metrics.jsonl, ordered by their first record."""
    found = [p.parent for p in folder.glob(f"*/{METRICS}")]
    first = {d: next(iter(read_metrics(RunDir(d).metrics)), {}).get("time", 0) for d in found}
    return sorted(found, key=lambda d: first[d])


# ---------------------------------------------------------------------------------------------- panels


def _loss(ax, run: _Run) -> None:
    ax.plot(*run.series("loss"), lw=1, label="train")
    if run.evals:
        ax.plot(*run.series("val_loss", run.evals), marker="o", ms=3, label="validation")
    ax.set_ylabel("loss")


def _lr(ax, run: _Run) -> None:
    ax.plot(*run.series("lr"), color="C2")
    ax.set_ylabel("learning rate")


def _throughput(ax, run: _Run) -> None:
    """tokens/s; MFU is proportional to it at a fixed world size: a second scale then, else a line."""
    ax.plot(*run.series("tokens_per_s"), color="C0", lw=1)
    ax.set_ylabel("tokens/s")
    ratios = {round(r["mfu"] / r["tokens_per_s"], 15) for r in run.train
              if _finite(r.get("mfu")) and r.get("tokens_per_s")}
    if len(ratios) == 1:
        k = 100 * ratios.pop()
        if k > 0:
            ax.secondary_yaxis("right", functions=(lambda t: t * k, lambda m: m / k)).set_ylabel("MFU %")
    elif ratios:
        mfu = ax.twinx()
        steps, values = run.series("mfu")
        mfu.plot(steps, [100 * v for v in values], color="C1", lw=1, ls="--", alpha=0.8)
        mfu.set_ylabel("MFU % (dashed)", color="C1")


def _memory(ax, run: _Run) -> None:
    steps, values = run.series("peak_mem_bytes")
    ax.plot(steps, [v / _GIB for v in values], color="C4")
    ax.set_ylabel("GiB")


def _grad_norm(ax, run: _Run) -> None:
    ax.plot(*run.series("grad_norm"), color="C3", lw=1)
    ax.set_yscale("log")
    ax.set_ylabel("global grad norm")


_PHASES = (("data_s", "data"), ("forward_backward_s", "forward+backward"), ("optimizer_s", "optimizer"))


def _step_time(ax, run: _Run) -> None:
    ax.plot(*run.series("step_time_s"), color="black", lw=1, label="step")
    for i, (key, label) in enumerate(_PHASES):
        if run.series(key)[0]:
            ax.plot(*run.series(key), lw=1, color=f"C{i + 5}", label=label)
    ax.set_ylabel("seconds")


def _moe(ax, run: _Run) -> None:
    ax.plot(*run.series("moe_load_imbalance"), label="load imbalance (mean over layers)")
    ax.plot(*run.series("moe_load_imbalance_max"), label="worst layer")
    ax.set_ylabel("max / mean tokens per expert")
    dropped = run.series("moe_dropped_fraction")
    if dropped[0] and any(dropped[1]):
        ax2 = ax.twinx()
        ax2.plot(dropped[0], [100 * v for v in dropped[1]], color="C3", alpha=0.6)
        ax2.set_ylabel("tokens dropped %", color="C3")


class _Panel(NamedTuple):
    name: str  # of its PNG
    title: str
    needs: str | None  # the train series a run must have for the panel (None: every run has it)
    draw: Callable[[Any, _Run], None]


_PANELS = [
    _Panel("loss", "loss", None, _loss),
    _Panel("lr", "learning rate", None, _lr),
    _Panel("throughput", "throughput", None, _throughput),
    _Panel("memory", "peak memory (rank 0)", "peak_mem_bytes", _memory),
    _Panel("grad_norm", "gradient norm", "grad_norm", _grad_norm),
    _Panel("step_time", "step time", "step_time_s", _step_time),
    _Panel("moe", "MoE load", "moe_load_imbalance", _moe),
]
_EVENT_STYLES = {"resize": dict(color="red", ls="--"), "resume": dict(color="grey", ls=":")}


def _finish(ax, title: str, run: _Run) -> None:
    """Resizes and resumes as vertical lines at their step (labelled once per panel); title, grid, legend."""
    seen = set()
    for e in run.events:
        if (kind := e.get("event")) in _EVENT_STYLES:
            ax.axvline(e["step"], lw=1.2, label=kind if kind not in seen else None, **_EVENT_STYLES[kind])
            seen.add(kind)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def _save(path: Path, panels: list[_Panel], run: _Run, overview: bool = False) -> Path:
    """One panel's PNG, or the overview's: every panel, two a row."""
    import matplotlib.pyplot as plt

    rows, cols = (math.ceil(len(panels) / 2), 2) if overview else (1, 1)
    size = (12, 3.2 * rows) if overview else (7, 3.6)
    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        panel.draw(ax, run)
        _finish(ax, panel.title, run)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    if overview:
        fig.suptitle(f"{run.name}: {run.train[-1]['step']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=100 if overview else 110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------- summary


def _summary(run: _Run, run_dir: Path, plots: list[Path]) -> str:
    cfg, last, train_cfg = run.config, run.train[-1], run.config.get("train") or {}
    lines = [f"# Run report: {run.name}", "", f"`{run_dir}`", "", "| | |", "| --- | --- |"]

    def row(name: str, value: str) -> None:
        lines.append(f"| {name} | {value} |")

    tail = run.train[-max(len(run.train) // 10, 1) :]  # the last tenth: the run's settled values
    settled = partial(_median, tail)
    row("steps", f"{last['step']}" + (f" of {train_cfg['steps']}" if train_cfg.get("steps") else ""))
    if run.attempts > 1:
        row("runs", f"{run.attempts} run folders in time order; {len(run.train)} steps recorded")
    row("model", _model_text(cfg))
    row("layout", _layout_text(cfg, run))
    row("train loss", f"{last['loss']:.4f} at the last step; {settled('loss'):.4f} median of the last tenth")
    if run.evals:
        best = min(run.evals, key=lambda r: r["val_loss"] if _finite(r["val_loss"]) else math.inf)
        last_val = run.evals[-1]["val_loss"]
        row("validation loss", f"{last_val:.4f} last; {best['val_loss']:.4f} best (step {best['step']})")
    row("tokens/s", f"{settled('tokens_per_s'):,.0f} median of the last tenth")
    row("MFU", f"{100 * settled('mfu'):.2f}% (train.peak_tflops={train_cfg.get('peak_tflops')})")
    peak = max((r.get("peak_mem_bytes", 0) for r in run.train), default=0)
    row("peak memory", f"{peak / _GIB:.2f} GiB on rank 0")
    row("step time", _step_time_text(tail))
    norms = [r for r in run.train if _finite(r.get("grad_norm"))]
    if norms:
        top = max(norms, key=lambda r: r["grad_norm"])
        row("grad norm", f"{settled('grad_norm'):.3g} median of the last tenth; "
            f"max {top['grad_norm']:.3g} (step {top['step']})")
    row("skipped steps", str(sum(1 for r in run.train if r.get("skipped"))))
    if run.series("moe_load_imbalance")[0]:
        dropped = 100 * settled("moe_dropped_fraction")
        row("MoE", f"load imbalance {settled('moe_load_imbalance'):.2f}, dropped {dropped:.2f}% (last tenth)")
    row("events", _events_text(run))
    checkpoints = [e for e in run.events if e.get("event") == "checkpoint"]
    if checkpoints:
        row("last checkpoint", f"`{checkpoints[-1].get('path')}`")
    times = [r["time"] for r in run.train + run.evals + run.events if _finite(r.get("time"))]
    row("wall time", f"{(max(times) - min(times)) / 60:.1f} min from the first record to the last")
    lines += ["", *(f"![{p.stem}]({p.name})" for p in plots if p.name == "overview.png"), ""]
    return "\n".join(lines)


def _model_text(cfg: dict[str, Any]) -> str:
    m = cfg.get("model") or {}
    if not m:
        return "n/a (no config.yaml)"
    moe = m.get("moe")
    kind = f"MoE {moe.get('num_experts')} experts top-{moe.get('top_k')}" if moe else "dense"
    return f"{kind}, {m.get('n_layers')} layers, dim {m.get('dim')}, {m.get('n_heads')} heads, vocab {m.get('vocab_size')}"


def _layout_text(cfg: dict[str, Any], run: _Run) -> str:
    par, train = cfg.get("parallel") or {}, cfg.get("train") or {}
    sizes = sorted({r.get("world_size") for r in run.train if r.get("world_size")})
    workers = "/".join(str(s) for s in sizes) or "?"
    pp_ep = "".join(f", {k}={par[k]}" for k in ("pp", "ep") if par.get(k, 1) > 1)
    return (
        f"engine {par.get('engine', '?')}{pp_ep}, {workers} workers, global batch {train.get('global_batch_size')}"
        f" x seq {(cfg.get('data') or {}).get('seq_len')}, {(cfg.get('precision') or {}).get('dtype', '?')}"
    )


def _step_time_text(rows: list[dict[str, Any]]) -> str:
    total = _median(rows, "step_time_s")
    parts = [
        f"{label} {_median(rows, key) / total:.0%}" for key, label in _PHASES if _finite(_median(rows, key))
    ]
    split = f" ({', '.join(parts)})" if parts and total > 0 else ""
    return f"{total:.3f} s median of the last tenth{split}"


def _events_text(run: _Run) -> str:
    out = []
    for e in run.events:
        if e.get("event") == "resume":
            out.append(f"resumed at step {e['step']} on {e.get('world_size')} workers")
        elif e.get("event") == "resize":
            sizes = f"{e.get('old_world_size')} -> {e.get('new_world_size')}"
            out.append(f"resized {sizes} workers at step {e['step']}")
        elif e.get("event") == "profile":
            out.append(f"profiled at step {e['step']}: `{Path(str(e.get('trace'))).parent}`")
    return "; ".join(out) or "none (one uninterrupted attempt)"


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [float(r[key]) for r in rows if _finite(r.get(key))]
    return statistics.median(values) if values else math.nan


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
