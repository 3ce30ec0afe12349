"""Lean steps on one CPU: the seed's naive loop against the Trainer with each memory technique alone and all
together, at the seed's reference model with a GPT-2-sized vocabulary.

    .venv/bin/python bench/lean.py --data data/stdlib-bpe        (what `make bench` runs)

The model: 4 blocks, width 256, 4 heads, context 512, 50,257 tokens (the seed's). The batch is 16 sequences,
not the seed's 32, so a CPU step takes seconds, not half a minute (`--batch`). Token ids come from a prepared
BPE corpus (`raytrain data prepare --tokenizer bpe`); the model's 50,257-way output is computed whatever ids
the corpus uses. Each row runs in its own fresh process (bench/measure.py): warmup steps, timed steps, then
one step under a live-tensor census for the peak (the CPU counterpart of torch.cuda.max_memory_allocated).
Rows run two at a time in lockstep (`GROUPS`; the naive loop beside all techniques together), so the time
ratio of the headline is step by step, with the machine's drift on both.
Every row is also planned by `trainers.plan.plan_memory` (the naive loop with `grads_kept`: its
`zero_grad()` keeps every gradient through the step). Writes bench/results/lean.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from measure import WORK, machine_cpu, other_cpu_share, reference_config, run_lockstep  # noqa: E402
from run import environment  # noqa: E402

from trainers.loss import chunk_tokens  # noqa: E402
from trainers.plan import plan_memory  # noqa: E402

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
MiB = 2**20
VOCAB, SEQ = 50257, 512
CHUNK = chunk_tokens(VOCAB)  # tokens per chunk of the chunked loss (what memory.fit: auto takes): 256
TARGETS = {"all_memory_ratio_min": 8.0, "all_time_ratio_max": 1.1, "plan_error_max": 0.10}
# name -> (variant, --set overrides, what it shows). `micro_batch` keeps the global batch (accumulation).
ALL = [f"memory.loss_chunk={CHUNK}", "memory.activation_checkpointing=every", "optimizer.fused=true",
       "train.micro_batch_size={quarter}"]
ROWS: dict[str, tuple[str, list[str], str]] = {
    "naive": ("naive", [], "the seed's naive loop: fp32, whole logits, zero_grad() keeps the gradients"),
    "plain": ("plain", [], "a plain loop: as naive, with zero_grad(set_to_none=True)"),
    "trainer": ("trainer", [], "the Trainer with every option off (holds its overhead: bench/run.py)"),
    "chunked_loss": ("trainer", [f"memory.loss_chunk={CHUNK}"], "the output projection and loss in chunks"),
    "ac_selective": ("trainer", ["memory.activation_checkpointing=selective"], "selective checkpointing"),
    "ac_every": ("trainer", ["memory.activation_checkpointing=every"], "full checkpointing of every block"),
    "fused_optimizer": ("trainer", ["optimizer.fused=true"], "torch's fused AdamW step"),
    "micro_batch": ("trainer", ["train.micro_batch_size={quarter}"], "4 micro-batches of a quarter each"),
    "compile": ("trainer", ["train.compile=true"], "torch.compile of each block (inductor)"),
    "bf16": ("trainer", ["precision.dtype=bf16"], "bf16 autocast (a GPU's speed-up; a CPU's memory)"),
    "bf16_chunked_loss": ("trainer", ["precision.dtype=bf16", f"memory.loss_chunk={CHUNK}"],
                          "bf16 autocast and the chunked loss (its matmuls in bf16, as the whole loss's)"),
    "all": ("trainer", ALL, "chunked loss + checkpointing + fused step + micro-batches"),
}
CPU_NOTE = (
    "On a CPU the step is bound by its matmuls. This CPU has avx512_bf16, so bf16 autocast ran 1.8x faster than fp32 "
    "here (a GPU's tensor cores give more); compile's fusion of memory-bound kernels pays most on a GPU's bandwidth. "
    "Step times of rows in different lockstep pairs drift with the machine; compare within a pair."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib-bpe", help="prepared corpus (raytrain data prepare)")
    p.add_argument("--out", default=str(BENCH / "results"))
    p.add_argument("--batch", type=int, default=16, help="sequences per step (the seed's 32, halved for a CPU)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--measured", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    return p.parse_args(argv)


def _overrides(name: str, batch: int) -> list[str]:
    return [o.format(quarter=max(batch // 4, 1)) for o in ROWS[name][1]]


def planned_bytes(name: str, args: argparse.Namespace) -> int:
    cfg = reference_config(args.data, args.batch, SEQ, 10, "off", "unused", False, VOCAB, _overrides(name, args.batch))
    return plan_memory(cfg, 1, "cpu", grads_kept=name == "naive").peak_bytes


# Rows measured together, in lockstep (measure.run_lockstep: step k of each in turn), so that the machine's
# drift, or another job on it, falls on both alike: the headline pair first.
# The chunked loss beside the whole loss, in fp32 and in bf16: is it free?
GROUPS = [("naive", "all"), ("trainer", "chunked_loss"), ("bf16", "bf16_chunked_loss"), ("plain", "ac_selective"),
          ("ac_every", "fused_optimizer"), ("micro_batch", "compile")]


def measure_group(names: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    shape = (args.batch, SEQ, args.warmup, args.measured)
    specs = [dict(name=f"lean-{n}", variant=ROWS[n][0], data=args.data, shape=shape, lean=ROWS[n][0] == "trainer",
                  vocab=VOCAB, overrides=_overrides(n, args.batch), work=WORK) for n in names]
    rows = []
    for name, run in zip(names, run_lockstep(specs)):
        peak, planned = run["live_tensor_peak_bytes"], planned_bytes(name, args)
        rows.append({
            "name": name,
            "what": ROWS[name][2],
            "overrides": _overrides(name, args.batch),
            "peak_bytes": peak,
            "step_time_s": statistics.median(run["step_times_s"]),
            "planned_bytes": planned,
            "plan_error": planned / peak - 1,
            "lockstep_with": [n for n in names if n != name],
            "step_times_s": run["step_times_s"],
            "step_cpu_times_s": run["step_cpu_times_s"],
            "warmup_step_times_s": run["warmup_step_times_s"],
            "rss_added_bytes": run["rss_added_bytes"],
            "losses": run["losses"],
            "other_processes_cpu_share": run["other_processes_cpu_share"],
        })
    return rows


def plot(result: dict[str, Any], path: Path) -> None:
    rows = result["rows"]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    y = range(len(rows))
    ax1.barh([i + 0.2 for i in y], [r["peak_bytes"] / MiB for r in rows], 0.4, label="measured (live tensors)")
    ax1.barh([i - 0.2 for i in y], [r["planned_bytes"] / MiB for r in rows], 0.4, label="planned", alpha=0.6)
    ax1.set_yticks(list(y), names)
    ax1.invert_yaxis()
    ax1.set_xlabel("peak memory, MiB")
    ax1.legend(loc="lower right")
    ax2.barh(list(y), [r["step_time_s"] for r in rows], color="tab:green")
    ax2.set_yticks(list(y), names)
    ax2.invert_yaxis()
    ax2.set_xlabel("median step time, s")
    a = result["all_vs_naive"]
    fig.suptitle(
        f"Lean steps, CPU: seed's model (vocab {VOCAB}, ctx {SEQ}), batch {result['batch']}; all vs naive: "
        f"memory / {a['memory_ratio']:.1f}, time x {a['time_ratio']:.2f}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown or "naive" not in names or "all" not in names:
        print(f"--rows {args.rows}: need naive and all, and only of {', '.join(ROWS)}", file=sys.stderr)
        return 2
    loadavg_before, cpu_before = os.getloadavg(), machine_cpu()
    print(f"Lean steps: {len(names)} rows, each a fresh process; batch {args.batch} x seq {SEQ}, vocab {VOCAB}")
    rows = []
    for group in GROUPS:
        chosen = [n for n in group if n in names]
        if chosen:
            rows += measure_group(chosen, args)
    by = {r["name"]: r for r in rows}
    naive, all_ = by["naive"], by["all"]
    step_ratios = [a / n for a, n in zip(all_["step_times_s"], naive["step_times_s"])]
    result = {
        **environment(args),  # bench/run.py's: the command, git commit, date, versions, load average at start
        "model": {"vocab_size": VOCAB, "dim": 256, "n_layers": 4, "n_heads": 4, "seq_len": SEQ},
        "batch": args.batch,
        "batch_note": "the seed's batch of 32 halved: a naive CPU step at 32 takes ~15 s",
        "data": f"{args.data}: token ids of a prepared BPE corpus (raytrain data prepare --tokenizer bpe)",
        "memory_measure": "peak bytes of live tensor storages during one step (trainers.metrics.LiveTensorBytes)",
        "rows": rows,
        "all_vs_naive": {
            "memory_ratio": naive["peak_bytes"] / all_["peak_bytes"],
            "time_ratio": statistics.median(step_ratios),  # the lockstep pair's step-by-step ratios
            "time_ratio_of_medians": all_["step_time_s"] / naive["step_time_s"],
            "step_ratios": step_ratios,
        },
        "targets": TARGETS,
        "max_plan_error": max(abs(r["plan_error"]) for r in rows),
        "cpu_note": CPU_NOTE,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
        "other_processes_cpu_share": other_cpu_share(cpu_before, machine_cpu()),
    }
    for whole, chunked in (("trainer", "chunked_loss"), ("bf16", "bf16_chunked_loss")):  # lockstep pairs
        if {whole, chunked} <= set(by):
            ratios = [c / w for c, w in zip(by[chunked]["step_times_s"], by[whole]["step_times_s"])]
            result[f"{chunked}_vs_whole"] = {"time_ratio": statistics.median(ratios), "step_ratios": ratios,
                                             "memory_ratio": by[whole]["peak_bytes"] / by[chunked]["peak_bytes"]}
    if {"ac_selective", "ac_every", "trainer"} <= set(by):
        off, sel, every = by["trainer"], by["ac_selective"], by["ac_every"]
        result["selective_between_off_and_every"] = {
            "memory": every["peak_bytes"] < sel["peak_bytes"] < off["peak_bytes"],
            "time": off["step_time_s"] < sel["step_time_s"] < every["step_time_s"],
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lean.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "lean.png")
    print(f"\n{'row':<16}{'peak MiB':>10}{'planned':>10}{'error':>8}{'step s':>9}")
    for r in rows:
        print(f"{r['name']:<16}{r['peak_bytes'] / MiB:>10.0f}{r['planned_bytes'] / MiB:>10.0f}"
              f"{r['plan_error']:>+8.1%}{r['step_time_s']:>9.2f}")
    a = result["all_vs_naive"]
    print(f"all vs naive: memory / {a['memory_ratio']:.2f} (target >= 8), time x {a['time_ratio']:.3f} "
          f"(target <= 1.1); planner's largest error {result['max_plan_error']:.1%} (target <= 10%)")
    for key in ("chunked_loss_vs_whole", "bf16_chunked_loss_vs_whole"):
        if key in result:
            print(f"{key}: time x {result[key]['time_ratio']:.3f} (lockstep), memory / {result[key]['memory_ratio']:.2f}")
    print(f"other processes' CPU share {result['other_processes_cpu_share']:.1%}; wrote {out / 'lean.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
