"""Mixture-of-experts: the per-expert loop against the grouped path (`model.moe.impl`), same model, same data.

    .venv/bin/python bench/moe.py --data data/stdlib      (CPU: tiny-moe, wide-moe; `make bench`)
    python bench/moe.py --device cuda                     (GPU: gpu-moe, the Mixtral-form model; a corpus of the
                                                          standard library is made under bench/_work if no --data)
    python bench/moe.py --device cuda --dry-run           (the GPU run's path on the CPU: gpu-moe's form made tiny,
                                                          bf16 and fused AdamW, compile off; moe-dry-run.json)

Each model runs as loop/grouped pairs of fresh Trainer processes in lockstep (bench/measure.py's
`run_lockstep`: step k of one, then step k of the other, who goes first alternating), so drift of a busy
machine hits both paths alike; a pair's speed-up is the median of its step-by-step ratios, the headline the
median over pairs. Rows: median step time, tokens/s, MFU on active parameters (the Trainer's formula,
`trainers.models.flops_per_token`, over `--peak-tflops`: on CPU the machine's own measured fp32 matmul
rate), peak memory (CPU: live tensor bytes, bench/measure.py's tracker; GPU: the Trainer's
`peak_mem_bytes`, torch.cuda.max_memory_allocated) and whether the two paths' losses agree.
Writes bench/results/moe.json: the latest CPU run at its top level, the latest GPU run under `gpu`, and
`rows` of both (a run on one device keeps the other's); the PNG is moe.png (CPU) or moe-gpu.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # trainers without an install (a bare GPU machine)

import torch  # noqa: E402
from corpus import prepared  # noqa: E402
from measure import machine_cpu, other_cpu_share, reference_config, run_lockstep
from run import environment

from trainers.metrics import read_metrics
from trainers.models import flops_per_token

BENCH = Path(__file__).resolve().parent
WORK = BENCH / "_work" / "moe"
IMPLS = ("loop", "grouped")
TARGETS = {"wide-moe": 1.3, "tiny-moe": 1.0}  # grouped / loop speed on this CPU, at least
MFU_TARGETS = {"gpu-moe": 0.35}  # the grouped path's MFU on active parameters (an H100), at least
# name: (model overrides, batch, seq, rtol of the losses of the two paths over the first steps)
MODELS: dict[str, tuple[dict[str, Any], int, int, float]] = {
    # examples/tiny-moe.yaml's model and batch
    "tiny-moe": ({"dim": 128, "n_layers": 2, "n_heads": 4, "moe": {"num_experts": 4, "top_k": 2}}, 16, 128, 1e-5),
    # wider and finer-grained: 16 experts of dim 512, top-2 (the loop's cost grows with the expert count)
    "wide-moe": ({"dim": 512, "n_layers": 2, "n_heads": 8, "moe": {"num_experts": 16, "top_k": 2}}, 8, 128, 1e-5),
    # the Mixtral form: dim 1024, 8 blocks, 8 experts top-2, vocabulary 32,000; bf16, fused AdamW, compile
    "gpu-moe": ({"dim": 1024, "n_layers": 8, "n_heads": 16, "vocab_size": 32000,
                 "moe": {"num_experts": 8, "top_k": 2}}, 8, 2048, 2e-2),
}
GPU_SETTINGS = {"precision": {"dtype": "bf16"}, "optimizer": {"fused": True}, "train": {"compile": True}}
# --dry-run: each model's form made tiny (same experts and top-k), the GPU settings less compile (inductor on
# two CPU cores takes minutes; bench/gpu.py's dry run compiles already), 1 warm-up and 2 timed steps
TINY = {"dim": 32, "n_layers": 2, "n_heads": 2, "vocab_size": 512}
DRY_GPU_SETTINGS = {**GPU_SETTINGS, "train": {"compile": False}}
LOSS_STEPS = 3  # the first losses compared (later ones drift apart by rounding, fastest in bf16)


def _flat(prefix: str, values: dict[str, Any]) -> list[str]:
    out = []
    for k, v in values.items():
        out += _flat(f"{prefix}{k}.", v) if isinstance(v, dict) else [f"{prefix}{k}={json.dumps(v)}"]
    return out


def model_shape(name: str, dry_run: bool = False) -> tuple[dict[str, Any], int, int, float]:
    """MODELS[name], or (--dry-run) its form at a tiny size: batch 4, sequence 32."""
    model, batch, seq, rtol = MODELS[name]
    return ({**model, **TINY}, 4, 32, max(rtol, 2e-2)) if dry_run else (model, batch, seq, rtol)


def overrides(name: str, impl: str, device: str, peak_tflops: float, dry_run: bool = False) -> list[str]:
    model, batch, seq, _ = model_shape(name, dry_run)
    sets = _flat("model.", {**model, "max_seq_len": seq}) + [f"model.moe.impl={impl}",
                                                              f"train.peak_tflops={peak_tflops}"]
    return sets + (_flat("", DRY_GPU_SETTINGS if dry_run else GPU_SETTINGS) if device == "cuda" else [])


def cpu_peak_tflops(n: int = 1024, repeats: int = 5) -> float:
    """This machine's fp32 matmul rate (the best of `repeats` n x n x n products): the CPU's 'peak' for MFU."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n**3 / best / 1e12


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_model(name: str, args: argparse.Namespace, peak_tflops: float) -> dict[str, Any]:
    model, batch, seq, rtol = model_shape(name, args.dry_run)
    vocab = model.get("vocab_size", 257)
    shape = (batch, seq, args.warmup, args.measured)
    before, runs = machine_cpu(), []
    for i in range(args.pairs):
        specs = [dict(name=f"{name}-{impl}-r{i}", variant="trainer", data=args.data, shape=shape, lean=True,
                      threads=args.threads, vocab=vocab, work=WORK,
                      overrides=overrides(name, impl, args.device, peak_tflops, args.dry_run)) for impl in IMPLS]
        pair = run_lockstep(specs if i % 2 == 0 else specs[::-1])
        runs.append({impl: next(r for r in pair if r["name"].startswith(f"{name}-{impl}")) for impl in IMPLS})
    speedups = [statistics.median(a / b for a, b in zip(p["loop"]["step_times_s"], p["grouped"]["step_times_s"]))
                for p in runs]
    worst = max(_rel(p["grouped"]["losses"][:LOSS_STEPS], p["loop"]["losses"][:LOSS_STEPS]) for p in runs)
    cfg = reference_config(args.data, batch, seq, 1, "off", str(WORK / "cfg"), False, vocab,
                           overrides(name, "auto", args.device, peak_tflops, args.dry_run))
    rows = [_row(name, impl, [p[impl] for p in runs], batch * seq, flops_per_token(cfg.model, seq), peak_tflops,
                 args.device, worst <= rtol) for impl in IMPLS]
    if args.dry_run:
        rows = [dict(r, ran_on="cpu", dry_run=True) for r in rows]
    return {
        "rows": rows,
        "speedup_grouped_over_loop": statistics.median(speedups),
        "speedup_per_pair": speedups,
        "losses_max_rel_diff_first_steps": worst,
        "losses_rtol": rtol,
        "other_processes_cpu_share": other_cpu_share(before, machine_cpu()),
    }


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _row(name: str, impl: str, runs: list[dict], tokens: int, flops: float, peak_tflops: float, device: str,
         agree: bool) -> dict[str, Any]:
    step = statistics.median(t for r in runs for t in r["step_times_s"])
    if device == "cuda":  # the Trainer's torch.cuda.max_memory_allocated over the run
        peak = max(m["peak_mem_bytes"] for r in runs for m in read_metrics(WORK / r["name"] / "metrics.jsonl", "train"))
    else:
        peak = statistics.median(r["live_tensor_peak_bytes"] for r in runs)
    return {"name": name, "device": device, "path": impl, "median_step_s": step, "tokens_per_s": tokens / step,
            "mfu": flops * tokens / step / (peak_tflops * 1e12), "peak_bytes": int(peak), "losses_agree": agree,
            "per_pair_median_step_s": [statistics.median(r["step_times_s"]) for r in runs]}


def _grouped(model: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in model["rows"] if r["path"] == "grouped")


def merged(path: Path, result: dict[str, Any], device: str) -> dict[str, Any]:
    """moe.json after `result` (a run on `device`): the CPU run at the top level, the GPU run under `gpu`, the
    rows of both in `rows`; the other device's latest run is kept."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    cpu = result if device == "cpu" else {k: v for k, v in old.items() if k != "gpu"}
    gpu = result if device == "cuda" else old.get("gpu")
    rows = [r for r in cpu.get("rows", []) if r["device"] == "cpu"] + (gpu["rows"] if gpu else [])
    return {**cpu, **({"gpu": gpu} if gpu else {}), "rows": rows}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, m in enumerate(models.values()):
        steps = {r["path"]: r["median_step_s"] for r in m["rows"]}
        for j, impl in enumerate(IMPLS):
            ax.bar(i + 0.38 * (j - 0.5), steps[impl], 0.36, color=f"C{j}", label=impl if i == 0 else None)
        ax.text(i, max(steps.values()) * 1.02, f"x{m['speedup_grouped_over_loop']:.2f}", ha="center")
    ax.set_xticks(range(len(models)), list(models))
    ax.set_ylabel("median step time (s)")
    load = result["environment"]["loadavg_at_start"][0]
    ax.set_title(f"MoE experts: loop vs grouped ({result['device']}, load avg {load:.1f})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=None,
                   help="prepared corpus (raytrain data prepare; default: the stdlib's, made under bench/_work/moe)")
    p.add_argument("--out", default=str(BENCH / "results"), help="folder for the JSON and PNG")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: tiny-moe, wide-moe; cuda: gpu-moe")
    p.add_argument("--models", nargs="*", help="a subset of the device's models")
    p.add_argument("--pairs", type=int, default=None,
                   help="loop/grouped pairs per model, in lockstep (default 4 on a CPU, 2 on a GPU: quiet, compiled)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of each run")
    p.add_argument("--measured", type=int, default=8, help="timed steps per run")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the runs (0 = torch's default)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="per-device peak for MFU (0: CPU = its measured fp32 matmul rate, CUDA = 989, H100 bf16)")
    p.add_argument("--dry-run", action="store_true",
                   help="the device's models made tiny, on the CPU, 1 + 2 steps (with --device cuda: the GPU run's "
                        "path, compile off); writes moe-dry-run.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        args.warmup, args.measured = 1, 2
    if args.device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        raise SystemExit("--device cuda: torch sees no CUDA device here; fix: run on a GPU machine")
    args.data = str(prepared(args.data, WORK / "corpus", 8_000_000))
    args.pairs = args.pairs or (2 if args.device == "cuda" else 4)
    names = args.models or (["gpu-moe"] if args.device == "cuda" else ["tiny-moe", "wide-moe"])
    peak = args.peak_tflops or (989.0 if args.device == "cuda" else 1.0 if args.dry_run else cpu_peak_tflops())
    env = dict(environment(args), targets=TARGETS, peak_tflops=peak,
               peak_tflops_source="--peak-tflops" if args.peak_tflops else
               ("H100 SXM bf16 dense" if args.device == "cuda" else "this CPU's measured fp32 1024^3 matmul rate"))
    models = {name: measure_model(name, args, peak) for name in names}
    env["loadavg_at_end"] = os.getloadavg()
    busy = max(m["other_processes_cpu_share"] for m in models.values())
    result = {
        "device": args.device,
        "dry_run": args.dry_run,
        "environment": env,
        "models": models,
        "rows": [row for m in models.values() for row in m["rows"]],
        "targets_met": {
            **{n: models[n]["speedup_grouped_over_loop"] >= TARGETS[n] for n in models if n in TARGETS},
            **{f"{n}_mfu": _grouped(models[n])["mfu"] >= MFU_TARGETS[n] for n in models if n in MFU_TARGETS},
        },
        "note": (f"other processes used {busy:.0%} of the CPUs during the run (load average "
                 f"{env['loadavg_at_start'][0]:.1f} at start, {env['loadavg_at_end'][0]:.1f} at end): step times "
                 "are inflated and noisy; the lockstep ratios (speedup_grouped_over_loop) are the robust figure"
                 if busy > 0.10 else "the machine was otherwise idle"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "moe-dry-run" if args.dry_run else "moe"
    (out / f"{name}.json").write_text(json.dumps(merged(out / f"{name}.json", result, args.device), indent=1))
    plot(result, out / (f"{name}.png" if args.device == "cpu" else f"{name}-gpu.png"))
    for name, m in models.items():
        cells = ", ".join(f"{r['path']} {r['median_step_s']:.3f} s/step {r['tokens_per_s']:.0f} tok/s "
                          f"MFU {100 * r['mfu']:.1f}% peak {r['peak_bytes'] / 2**20:.0f} MiB" for r in m["rows"])
        print(f"{name}: {cells}; grouped x{m['speedup_grouped_over_loop']:.2f} (pairs "
              f"{', '.join(f'{s:.2f}' for s in m['speedup_per_pair'])}); losses agree: {m['rows'][0]['losses_agree']}")
    print(result["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
