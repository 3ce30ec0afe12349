"""The figure of bench/run.py: Trainer vs plain step time, and activation checkpointing off vs every."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plot"]

MiB = 2**20
NOISY = 0.05  # share of the CPUs used by other processes during a run
COLORS = {"plain": "#7f7f7f", "trainer": "#1f77b4", "off": "#ff7f0e", "every": "#2ca02c"}


def plot(result: dict[str, Any], path: Path) -> None:
    fig = Figure(figsize=(12, 4.8))  # no pyplot: the Agg canvas, no global figure state
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    _overhead_panel(left, result["overhead"])
    _ac_panel(right, result["activation_checkpointing"])
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _title(result: dict[str, Any]) -> str:
    title = (
        f"raytrain-ext on CPU ({result['cpus_usable']} cores, torch {result['torch_version']}, "
        f"{result['date'][:10]})"
    )
    busiest = result["max_other_processes_cpu_share"]
    if busiest > NOISY:
        title += f" - NOISY: other processes used up to {busiest:.0%} of the CPUs; timings unreliable"
    return title


def _overhead_panel(ax, overhead: dict[str, Any]) -> None:
    names = ["plain", "trainer"]
    for i, name in enumerate(names):
        s = overhead[name]
        ax.bar(i, s["median_step_s"], color=COLORS[name], width=0.6)
        repeats = s["per_repeat_median_step_s"]
        ax.plot([i] * len(repeats), repeats, "k_", markersize=18, label="median of one run" if i else None)
    ax.set_xticks(range(len(names)), ["plain PyTorch loop", "Trainer (TensorBoard on)"])
    ax.set_ylabel("median step time (s)")
    ax.set_title(
        f"step time: Trainer / plain = {overhead['ratio_median']:.3f}, p10-p90 {overhead['ratio_p10']:.3f}-"
        f"{overhead['ratio_p90']:.3f} over {len(overhead['per_pair_ratios'])} pairs "
        f"(target <= {overhead['target_ratio_max']})",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)


def _ac_panel(ax, ac: dict[str, Any]) -> None:
    width, twin = 0.35, ax.twinx()
    for j, mode in enumerate(("off", "every")):
        s, x = ac[mode], [k + (j - 0.5) * width for k in range(3)]
        label = f"activation checkpointing {mode}"
        ax.bar(
            x[:2],
            [s["live_tensor_peak_bytes"] / MiB, s["rss_added_bytes"] / MiB],
            width,
            color=COLORS[mode],
            label=label,
        )
        twin.bar(x[2], s["median_step_s"], width, color=COLORS[mode], hatch="//", edgecolor="white")
        twin.plot(
            [x[2]] * len(s["per_repeat_median_step_s"]), s["per_repeat_median_step_s"], "k_", markersize=12
        )
    ax.set_xticks(range(3), ["peak live tensors (MiB)", "peak RSS added (MiB)", "median step time (s) ->"])
    ax.set_ylabel("MiB")
    twin.set_ylabel("s")
    ax.set_title(
        f"AC every vs off: memory / {ac['memory_cut_live_tensors']:.2f} (live), "
        f"/ {ac['memory_cut_rss_added']:.2f} (RSS); time x {ac['time_ratio']:.2f}",
        fontsize=10,
    )
    ax.set_ylim(top=ax.get_ylim()[1] * 1.2)  # room for the legend
    twin.set_ylim(top=twin.get_ylim()[1] * 1.2)
    ax.legend(loc="upper left", fontsize=8)
