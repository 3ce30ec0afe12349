"""The figure of bench/zero_memory.py: per-rank model state (measured vs the ZeRO formula), peak memory and
step time per engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from plot import NOISY

__all__ = ["plot_zero"]

MiB = 2**20
PARTS = {  # measured category -> colour; the formula's "optimizer" is master + optim_states
    "params": "#1f77b4",
    "grads": "#ff7f0e",
    "master": "#9467bd",
    "optim_states": "#2ca02c",
}
FORMULA_PARTS = {"params": "params", "grads": "grads", "optimizer": "optim_states"}


def plot_zero(result: dict[str, Any], path: Path) -> None:
    configs = result["configs"]
    fig = Figure(figsize=(17, 5.8))  # no pyplot: the Agg canvas, no global figure state
    FigureCanvasAgg(fig)
    state_ax, peak_ax, time_ax = fig.subplots(1, 3, gridspec_kw={"width_ratios": [2.2, 1.2, 1]})
    names = [c["name"] for c in configs]
    _state_panel(state_ax, configs, names)
    _peak_panel(peak_ax, configs, names)
    _time_panel(time_ax, configs, names)
    fig.suptitle(_title(result), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _title(result: dict[str, Any]) -> str:
    title = (
        f"ZeRO model state per rank, {result['configs'][0]['world_size']} processes, reference model "
        f"(P = {result['configs'][0]['n_params']:,}), CPU gloo, torch {result['torch_version']}, "
        f"{result['date'][:10]}"
    )
    busiest = result["max_other_processes_cpu_share"]
    if busiest > NOISY:
        title += f"\nNOISY: other processes used up to {busiest:.0%} of the CPUs; step times unreliable"
    return title


def _state_panel(ax, configs: list[dict[str, Any]], names: list[str]) -> None:
    width = 0.38
    for i, c in enumerate(configs):
        bottom = 0.0
        for part, color in PARTS.items():
            value = c["measured_bytes"][part] / MiB
            ax.bar(i - width / 2, value, width, bottom=bottom, color=color)
            bottom += value
        top, f_bottom = bottom, 0.0
        for part, color_key in FORMULA_PARTS.items():
            value = c["formula_bytes"][part] / MiB
            ax.bar(
                i + width / 2, value, width, bottom=f_bottom, color=PARTS[color_key], alpha=0.35, hatch="//"
            )
            f_bottom += value
        high = c["model_state_high_water"]["bytes"] / MiB
        ax.plot(
            [i - width / 2],
            [high],
            "k_",
            markersize=22,
            label="most held at a measured moment" if not i else None,
        )
        ratio = c["ratio_measured_to_formula"]["model_state"]
        ax.text(i, max(top, f_bottom, high) + 0.8, f"{ratio:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MiB per rank (at the optimizer step)")
    ax.set_title(
        "model state: measured (left, solid) vs ZeRO formula (right, hatched); label = ratio", fontsize=10
    )
    handles = [Patch(color=color, label=part) for part, color in PARTS.items()]
    handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//", label="formula"))
    handles.append(Line2D([], [], color="k", marker="_", linestyle="", markersize=14, label="high-water"))
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.1)


def _peak_panel(ax, configs: list[dict[str, Any]], names: list[str]) -> None:
    width = 0.38
    live = [max(c["live_tensor_peak_bytes_per_rank"]) / MiB for c in configs]
    rss = [max(c["rss_added_bytes_per_rank"]) / MiB for c in configs]
    x = range(len(configs))
    ax.bar([i - width / 2 for i in x], live, width, color="#8c564b", label="peak live tensors")
    ax.bar([i + width / 2 for i in x], rss, width, color="#7f7f7f", label="peak RSS added")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("MiB per rank (largest rank; log scale)")
    ax.set_title("peak memory (DeepSpeed buckets capped at the model size)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")


def _time_panel(ax, configs: list[dict[str, Any]], names: list[str]) -> None:
    x = range(len(configs))
    ax.bar(x, [c["median_step_s"] for c in configs], 0.6, color="#17becf", label="median")
    ax.plot(x, [c["min_step_s"] for c in configs], "k_", markersize=14, label="fastest step")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("s per step (global batch 16 x seq 256)")
    ax.set_title("step time, 1 torch thread per rank", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
