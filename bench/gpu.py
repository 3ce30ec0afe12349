"""One GPU: the memory techniques against their speed, the device-aware fit, the planner, and a peer.

    python bench/gpu.py                  (`make bench-gpu`): every row on this machine's GPU, ~20 min on an H100
    python bench/gpu.py --model small    the large model scaled down for a GPU with 24 GB
    python bench/gpu.py --dry-run        every row on the CPU at a tiny size (CI: the script works)
    python bench/gpu.py --rows big/bf16-compile,big/compile-chunk4096      a subset (results merge by name)
    python bench/gpu.py --targets        only the 8 rows the targets read (`checks`), most telling first: ~half
                                         the time, for a short GPU lease (split further with --rows)

Two sections. `big/`: a 1.1B Llama-form model (dim 2048, 16 blocks, 16 heads, vocabulary 32,000), sequence 2048,
batch 8, bf16 autocast: eager, fused AdamW, `train.compile`, + selective checkpointing, + the chunked loss,
`memory.fit: auto` at global batch 32 asked as one micro-batch against hand-picked plans of the same batch, FSDP2
in a group of one, and the peer: a plain `transformers` LlamaForCausalLM loop of the same dims (when
transformers is installed). `seed/`: the seed's reference shape (4 blocks, width 256, 4 heads, context 512,
vocabulary 50,257, batch 32): its naive fp32 loop (bench/plain_loop.py, gradients zeroed not freed) against the
Trainer with each technique alone and all together.

Each row runs in its own fresh process (CUDA's peak counter, the compile caches and the allocator start clean),
25 steps, the median of the last 2/3; a row that fails or runs past --row-timeout is recorded with its error and
the others go on. Per row: `name`, `median_step_s`, `tokens_per_s`, `mfu` (of --peak-tflops, by default the
device's dense bf16 figure), `peak_bytes` (torch.cuda.max_memory_allocated; on a CPU the peak of live tensor
bytes over one step), `planned_bytes` (trainers.plan.plan_memory for the device), `run_id` (the run that wrote it:
BENCH_RUN_ID, which bench/gpu_check.sh sets once for all its parts, else one made per invocation); `checks` holds
the issue's targets. Rows of earlier runs are kept where this run does not measure them again, so a check that
compares rows compares rows of one run only: else its value is null and its note names the runs. Writes
bench/results/gpu.json (after every row: an interrupted run keeps what it measured) and gpu.png, with the run's
provenance (bench/provenance.py's fields; `measures`: the code its figures are of, for bench/stale.py).
Imports neither ray nor deepspeed (the GPU machine may have neither).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]  # plain_loop; trainers without an install of this project

import torch  # noqa: E402
from corpus import prepared  # noqa: E402
from plain_loop import train as train_plain  # noqa: E402
from provenance import dirty_paths, git_state, versions  # noqa: E402

from trainers._base import scoped_environ  # noqa: E402
from trainers.autofit import resolve_fit  # noqa: E402
from trainers.config import RunConfig, apply_overrides, parse_config  # noqa: E402
from trainers.data.dataset import GlobalSampler, TokenWindows  # noqa: E402
from trainers.metrics import LiveTensorBytes  # noqa: E402
from trainers.models import flops_per_token  # noqa: E402
from trainers.parallel.distributed import group_of_one  # noqa: E402
from trainers.plan import plan_memory  # noqa: E402
from trainers.trainer import Trainer, TrainerCallback  # noqa: E402

WORK = BENCH / "_work" / "gpu"
# The code the figures are of (bench/stale.py lists gpu.json once one of these changes after its commit).
MEASURES = ["bench/gpu.py", "bench/gpu_check.sh", "bench/plain_loop.py", "trainers/"]
# Dense bf16 tensor-core peaks (TFLOP/s), by the first key in torch.cuda.get_device_name: MFU's denominator
# (the H100's variants before the SXM part's "H100").
PEAK_TFLOPS = {"H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "A10": 125.0,
               "L4": 121.0, "4090": 165.0, "3090": 71.0}
TARGETS = {"chunked_vs_whole_step_max": 1.05, "fit_vs_best_hand_mfu_min": 0.9, "plan_error_max": 0.10,
           "seed_all_memory_ratio_min": 10.0, "seed_all_speed_ratio_min": 2.0, "big_compile_mfu_min": 0.50}
# Model sizes per --model: the large section's model and batch, the seed section's.
SIZES: dict[str, dict[str, Any]] = {
    "1.1b": {"big": {"vocab_size": 32000, "dim": 2048, "n_layers": 16, "n_heads": 16}, "big_seq": 2048,
             "big_batch": 8, "big_global": 32, "seed": {"vocab_size": 50257, "dim": 256, "n_layers": 4,
                                                        "n_heads": 4}, "seed_seq": 512, "seed_batch": 32,
             "steps": 25},
    "small": {"big": {"vocab_size": 32000, "dim": 1024, "n_layers": 12, "n_heads": 8}, "big_seq": 2048,
              "big_batch": 4, "big_global": 16, "seed": {"vocab_size": 50257, "dim": 256, "n_layers": 4,
                                                         "n_heads": 4}, "seed_seq": 512, "seed_batch": 32,
              "steps": 25},
    "tiny": {"big": {"vocab_size": 512, "dim": 64, "n_layers": 2, "n_heads": 4}, "big_seq": 64, "big_batch": 4,
             "big_global": 16, "seed": {"vocab_size": 1024, "dim": 32, "n_layers": 2, "n_heads": 2},
             "seed_seq": 64, "seed_batch": 8, "steps": 4},
}
BF16_FUSED = ("precision.dtype=bf16", "optimizer.fused=true")
COMPILED = (*BF16_FUSED, "train.compile=true")


@dataclass(frozen=True)
class Row:
    name: str  # section/what
    kind: str  # trainer | naive (the seed's loop) | peer (transformers) | group (the Trainer in a group of one)
    sets: tuple[str, ...] = ()  # --set overrides of the section's config ({batch}, {global}: the section's)
    what: str = ""
    env: tuple[tuple[str, str], ...] = ()

    @property
    def section(self) -> str:
        return self.name.split("/")[0]


SEED_ALL = (*COMPILED, "memory.loss_chunk=256", "memory.activation_checkpointing=selective")
ROWS = [
    Row("big/bf16-eager", "trainer", ("precision.dtype=bf16",), "bf16 autocast, eager"),
    Row("big/bf16-fused", "trainer", BF16_FUSED, "+ fused AdamW"),
    Row("big/bf16-compile", "trainer", COMPILED, "+ train.compile (the whole loss)"),
    Row("big/compile-selective", "trainer", (*COMPILED, "memory.activation_checkpointing=selective"),
        "+ selective activation checkpointing"),
    Row("big/compile-chunk4096", "trainer", (*COMPILED, "memory.loss_chunk=4096"),
        "+ the chunked loss, 4096 tokens a chunk (instead of selective)"),
    Row("big/compile-chunk4096-eager-loss", "trainer", (*COMPILED, "memory.loss_chunk=4096"),
        "as above, the chunk's pointwise steps eager (RAYTRAIN_LOSS_COMPILE=0): what compiling them pays",
        (("RAYTRAIN_LOSS_COMPILE", "0"),)),
    Row("big/fit-auto-gb{global}", "trainer", (*COMPILED, "train.global_batch_size={global}",
                                              "train.micro_batch_size={global}", "memory.fit=auto"),
        "memory.fit: auto, the global batch asked as one micro-batch"),
    Row("big/hand-mb{batch}-gb{global}", "trainer", (*COMPILED, "train.global_batch_size={global}"),
        "hand-picked: micro-batch {batch}, accumulation to the same global batch"),
    Row("big/hand-mb{double}-selective-gb{global}", "trainer",
        (*COMPILED, "train.global_batch_size={global}", "train.micro_batch_size={double}",
         "memory.activation_checkpointing=selective"), "hand-picked: twice the micro-batch, selective AC"),
    Row("big/fsdp2-1rank-compile", "group", (*COMPILED, "parallel.engine=fsdp"),
        "FSDP2 in a process group of one (as torchrun --nproc-per-node 1)"),
    Row("big/peer-hf-compile", "peer", COMPILED, "a plain transformers LlamaForCausalLM loop, same dims"),
    Row("seed/naive-fp32", "naive", (), "the seed's naive loop: fp32 (no TF32), zero_grad() keeps gradients"),
    Row("seed/trainer-fp32", "trainer", ("precision.tf32=false",), "the Trainer, every option off, true fp32"),
    Row("seed/tf32", "trainer", (), "+ TF32 matmuls (precision.tf32, the default)"),
    Row("seed/bf16", "trainer", ("precision.dtype=bf16",), "bf16 autocast"),
    Row("seed/compile", "trainer", ("train.compile=true",), "train.compile"),
    Row("seed/fused", "trainer", ("optimizer.fused=true",), "fused AdamW"),
    Row("seed/chunk256", "trainer", ("memory.loss_chunk=256",), "the chunked loss, 256 tokens a chunk"),
    Row("seed/selective", "trainer", ("memory.activation_checkpointing=selective",), "selective AC"),
    Row("seed/micro-batch", "trainer", ("train.micro_batch_size={quarter}",), "4 micro-batches of a quarter"),
    Row("seed/all", "trainer", SEED_ALL, "all together: chunked loss 256, selective AC, compile, bf16, fused"),
    Row("seed/all-chunk-a-call", "trainer", SEED_ALL,
        "as seed/all, one chunk a compiled call (RAYTRAIN_LOSS_CHUNKS_PER_CALL=1) instead of 8: what grouping pays",
        (("RAYTRAIN_LOSS_CHUNKS_PER_CALL", "1"),)),
    Row("seed/all-chunk4096", "trainer", (*COMPILED, "memory.loss_chunk=4096",
                                          "memory.activation_checkpointing=selective"), "as all, chunk 4096"),
]
# What `checks` reads, in the order --targets runs them: the headline MFU and the chunked loss against it,
# the peer, the fit against the hand-picked plans, then the seed's naive loop against all techniques.
TARGET_ROWS = ("big/bf16-compile", "big/compile-chunk4096", "big/peer-hf-compile", "big/fit-auto-gb{global}",
               "big/hand-mb{batch}-gb{global}", "big/hand-mb{double}-selective-gb{global}", "seed/naive-fp32",
               "seed/all")


# ------------------------------------------------------------------------------------------- configs


def _fill(text: str, size: dict[str, Any], section: str) -> str:
    batch = size[f"{section}_batch"]
    return text.format(batch=batch, double=2 * batch, quarter=max(batch // 4, 1), **{"global": size["big_global"]})


def rows_for(size: dict[str, Any]) -> list[Row]:
    """ROWS with the size's batches in their names and overrides."""
    out = []
    for r in ROWS:
        sec = r.section
        out.append(Row(_fill(r.name, size, sec), r.kind, tuple(_fill(s, size, sec) for s in r.sets),
                       _fill(r.what, size, sec), r.env))
    return out


def row_config(row: Row, size: dict[str, Any], data: str, run_dir: Path) -> RunConfig:
    section = row.section
    seq, batch = size[f"{section}_seq"], size[f"{section}_batch"]
    raw = {
        "name": row.name.replace("/", "-"),
        "seed": 0,
        "run_dir": str(run_dir),
        "model": {**size[section], "max_seq_len": seq},
        "data": {"path": data, "seq_len": seq},
        "optimizer": {"name": "adamw", "lr": 3e-4, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"name": "warmup_cosine", "warmup_steps": min(5, size["steps"] - 1)},
        "precision": {"dtype": "fp32"},
        "train": {"steps": size["steps"], "global_batch_size": batch, "micro_batch_size": batch,
                  "eval_every": 0, "eval_batches": 1, "tensorboard": False},
        "checkpoint": {"every": 0, "final": False, "resume": "none"},  # no save: 10.5 GB a row at 1.1B
    }
    return parse_config(apply_overrides(raw, list(row.sets)))


# ---------------------------------------------------------------------------------------- one row


class Meter:
    """Step times (after a device sync) and, on a CPU, the live-tensor peak of step 2 (the CUDA counter is
    the process's own: a fresh process per row)."""

    def __init__(self, device: torch.device):
        self.device, self.stamps, self.losses = device, [], []
        self.tracker = LiveTensorBytes() if device.type == "cpu" else None

    def after_step(self, step: int, loss: float, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        self.losses.append(float(loss))
        if self.tracker is not None and step == 1:
            state = [*model.parameters(), *model.buffers()]
            state += [p.grad for p in model.parameters() if p.grad is not None]
            state += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            self.tracker.register(state)
            self.tracker.__enter__()
        elif self.tracker is not None and step == 2:
            self.tracker.__exit__(None, None, None)

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return int(self.tracker.peak)

    def median_step_s(self) -> float:
        """The median of the last 2/3 of the steps (the first third warms up: compile, the allocator)."""
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
        return statistics.median(gaps[len(gaps) // 3:] or gaps)


class _MeterCallback(TrainerCallback):
    def __init__(self, meter: Meter):
        self.meter = meter

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.meter.after_step(trainer.step, record["loss"], trainer.model, trainer.engine.optimizer)


def run_row(row: Row, size: dict[str, Any], data: str, device: torch.device) -> dict[str, Any]:
    """Train one row in this process; its measurements."""
    run_dir = WORK / "runs" / row.name.replace("/", "-")
    cfg = row_config(row, size, data, run_dir)
    meter, out = Meter(device), {}
    if row.kind == "naive":
        train_plain(cfg, TokenWindows(cfg.data.path, "train", cfg.data.seq_len), meter.after_step, False, device)
    elif row.kind == "peer":
        _peer(cfg, device, meter)
    else:
        with group_of_one() if row.kind == "group" else contextlib.nullcontext():
            cfg, choice = resolve_fit(cfg)
            if choice is not None:
                out["fit_line"] = choice.line
                out["fit_changes"] = choice.changes
            Trainer(cfg, callbacks=[_MeterCallback(meter)], progress=False).fit()
    step_s = meter.median_step_s()
    tokens_per_s = cfg.train.global_batch_size * cfg.data.seq_len / step_s
    planned = None if row.kind == "peer" else plan_memory(cfg, 1, device.type, grads_kept=row.kind == "naive")
    return dict(out, median_step_s=step_s, tokens_per_s=tokens_per_s, peak_bytes=meter.peak_bytes(),
                planned_bytes=planned.peak_bytes if planned else None,
                flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len),
                micro_batch_size=cfg.train.micro_batch_size, global_batch_size=cfg.train.global_batch_size,
                step_times_s=[b - a for a, b in zip(meter.stamps, meter.stamps[1:])], losses=meter.losses)


def _peer(cfg: RunConfig, device: torch.device, meter: Meter) -> None:
    """A plain Hugging Face loop of the same dims: LlamaForCausalLM (SDPA attention), bf16 autocast over fp32
    weights, fused AdamW, torch.compile of the whole model, the model's own loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    conf = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.hidden_dim,
                       num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
                       max_position_embeddings=cfg.data.seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
                       tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(conf).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, fused=cfg.optimizer.fused)
    step_fn = torch.compile(model) if cfg.train.compile else model
    data = TokenWindows(cfg.data.path, "train", cfg.data.seq_len)
    sampler, batch = GlobalSampler(data.num_windows, cfg.seed, cfg.data.shuffle), cfg.train.global_batch_size
    for step in range(cfg.train.steps):
        x, _ = (t.to(device) for t in data.get(sampler.window_ids(step * batch, batch)))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = step_fn(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter.after_step(step + 1, loss.item(), model, opt)


# ------------------------------------------------------------------------------------------- driver


def device_info(device: torch.device, peak: float | None) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    if peak is None and device.type == "cuda":
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return {"device": device.type, "device_name": name, "peak_tflops": peak,
            "device_memory_bytes": (torch.cuda.get_device_properties(device).total_memory
                                    if device.type == "cuda" else None)}


def one_row_in_a_fresh_process(row: Row, args: argparse.Namespace, data: str) -> dict[str, Any]:
    out = WORK / f"{row.name.replace('/', '-')}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", row.name, "--one-out", str(out),
           "--model", args.model, "--data", data]
    env = {**os.environ, **dict(row.env)}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past --row-timeout {args.row_timeout} s"}
    if proc.returncode or not out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out.read_text())


def measure(row: Row, args: argparse.Namespace, size: dict[str, Any], data: str,
            device: torch.device) -> dict[str, Any]:
    if args.dry_run:  # in this process: a tiny size, and CI's time
        with scoped_environ(**dict(row.env)):
            try:
                return run_row(row, size, data, device)
            except ImportError as e:  # the peer row without transformers
                return {"error": f"{type(e).__name__}: {e}"}
    return one_row_in_a_fresh_process(row, args, data)


def run_of(row: dict[str, Any]) -> str | None:
    """The run that wrote a row (None for a row written before rows carried one: its run is not known)."""
    return row.get("run_id")


def checks(rows: dict[str, dict[str, Any]], size: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, from whichever rows were measured (a target whose rows are missing is left out). A
    target that compares rows compares rows of one run (`run_id`): with rows of two runs, or one whose run is
    not known, its value and `met` are null and `note` says why (a ratio of rows measured at other commits, or
    on another day's machine, would pass for one measurement)."""
    ok = {name: r for name, r in rows.items() if "error" not in r}
    g = size["big_global"]
    out: dict[str, Any] = {}

    def add(key: str, names: list[str], value: Any, target: float | None, at_most: bool = False) -> None:
        """`value`: a function of the rows `names`, called only when they are of one run."""
        runs = {run_of(ok[n]) for n in names}
        entry: dict[str, Any] = {"rows": names}
        if len(runs) == 1 and None not in runs:
            v = value()
            entry.update(value=v, run_id=runs.pop(),
                         met=(v > 0 if target is None else v <= target if at_most else v >= target))
        else:
            entry.update(value=None, met=None, note="rows of different runs: " + ", ".join(
                f"{n} (run {run_of(ok[n]) or 'unknown'}, commit {ok[n].get('git_commit')})" for n in names)
                + "; fix: measure them in one run (bench/gpu_check.sh)")
        if target is not None:
            entry["target"] = target
        out[key] = entry

    if {"big/compile-chunk4096", "big/bf16-compile"} <= set(ok):
        add("chunked_vs_whole_step", ["big/compile-chunk4096", "big/bf16-compile"],
            lambda: ok["big/compile-chunk4096"]["median_step_s"] / ok["big/bf16-compile"]["median_step_s"],
            TARGETS["chunked_vs_whole_step_max"], True)
    fit_name = f"big/fit-auto-gb{g}"
    fit = ok.get(fit_name)
    if fit and fit.get("mfu") is not None:
        # the hand-picked plans of the fit's run (another run's plans are not this run's alternatives)
        hands = [n for n, r in ok.items() if n.startswith("big/hand-") and r.get("mfu") is not None]
        same = [n for n in hands if run_of(ok[n]) is not None and run_of(ok[n]) == run_of(fit)]
        if hands:
            add("fit_vs_best_hand_mfu", [fit_name, *(same or hands)],
                lambda: fit["mfu"] / max(ok[n]["mfu"] for n in same), TARGETS["fit_vs_best_hand_mfu_min"])
    errors = [abs(r["planned_bytes"] / r["peak_bytes"] - 1) for r in ok.values() if r.get("planned_bytes")]
    if errors:  # each row's own plan against its own peak: no row compared with another
        out["plan_error_max"] = {"value": max(errors), "target": TARGETS["plan_error_max"],
                                 "met": max(errors) <= TARGETS["plan_error_max"]}
    if {"seed/naive-fp32", "seed/all"} <= set(ok):
        naive, all_ = ok["seed/naive-fp32"], ok["seed/all"]
        add("seed_all_memory_ratio", ["seed/naive-fp32", "seed/all"], lambda: naive["peak_bytes"] / all_["peak_bytes"],
            TARGETS["seed_all_memory_ratio_min"])
        add("seed_all_speed_ratio", ["seed/naive-fp32", "seed/all"],
            lambda: naive["median_step_s"] / all_["median_step_s"], TARGETS["seed_all_speed_ratio_min"])
    compiled = ok.get("big/bf16-compile")
    if compiled and compiled.get("mfu") is not None:
        mfu = compiled["mfu"]
        out["big_compile_mfu"] = {"value": mfu, "target": TARGETS["big_compile_mfu_min"],
                                  "met": mfu >= TARGETS["big_compile_mfu_min"]}
        peer = ok.get("big/peer-hf-compile")
        if peer and peer.get("mfu") is not None:
            add("big_compile_ahead_of_peer", ["big/bf16-compile", "big/peer-hf-compile"], lambda: mfu - peer["mfu"],
                None)
    return out


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rows"] if "error" not in r]
    names = [r["name"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.35 * len(rows) + 2))
    y = list(range(len(rows)))
    ax1.barh(y, [(r["mfu"] or 0) * 100 for r in rows], color="tab:green")
    ax1.set_xlabel(f"MFU, % of {result['peak_tflops']} TFLOP/s" if result["peak_tflops"] else "MFU (no peak known)")
    ax2.barh([i + 0.2 for i in y], [r["peak_bytes"] / 2**30 for r in rows], 0.4, label="measured peak")
    ax2.barh([i - 0.2 for i in y], [(r["planned_bytes"] or 0) / 2**30 for r in rows], 0.4, label="planned", alpha=0.6)
    ax2.set_xlabel("GiB")
    ax2.legend(loc="lower right")
    for ax in (ax1, ax2):
        ax.set_yticks(y, names if ax is ax1 else [""] * len(y))
        ax.invert_yaxis()
    fig.suptitle(f"bench/gpu.py on {result['device_name']} (torch {result['torch_version']}, --model {result['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("1.1b", "small"), default="1.1b", help="small: for a GPU with 24 GB")
    p.add_argument("--dry-run", action="store_true", help="every row on the CPU at a tiny size, in this process")
    p.add_argument("--rows", default="", help="comma-separated row names (default: all); results merge by name")
    p.add_argument("--targets", action="store_true", help="only the rows the targets read, most telling first")
    p.add_argument("--data", default=None, help="a prepared corpus (default: byte tokens of the stdlib)")
    p.add_argument("--out", default=str(BENCH / "results"))
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU's denominator (default: the device's)")
    p.add_argument("--row-timeout", type=int, default=900, help="seconds a row's process may take")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one row, in this process
    p.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = SIZES["tiny" if args.dry_run else args.model]
    rows = rows_for(size)
    device = torch.device("cuda") if torch.cuda.is_available() and not args.dry_run else torch.device("cpu")
    if args.one:  # the child of one_row_in_a_fresh_process
        row = next(r for r in rows if r.name == args.one)
        Path(args.one_out).write_text(json.dumps(run_row(row, size, args.data, device)))
        return 0
    if device.type != "cuda" and not args.dry_run:
        print("bench/gpu.py: no CUDA device here; fix: run it on a GPU, or pass --dry-run", file=sys.stderr)
        return 2
    wanted = [n.strip() for n in args.rows.split(",") if n.strip()]
    if args.targets:
        wanted += [_fill(n, size, n.split("/")[0]) for n in TARGET_ROWS]
    unknown = sorted(set(wanted) - {r.name for r in rows})
    if unknown:
        print(f"--rows: unknown {', '.join(unknown)}; fix: choose of {', '.join(r.name for r in rows)}", file=sys.stderr)
        return 2
    by_row = {r.name: r for r in rows}
    chosen = [by_row[n] for n in dict.fromkeys(wanted)] if wanted else rows  # in the order asked
    data = str(prepared(args.data, WORK / ("corpus-tiny" if args.dry_run else "corpus"),
                        300_000 if args.dry_run else 8_000_000, val_fraction=0.2))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("gpu-dry-run.json" if args.dry_run else "gpu.json")
    info = device_info(device, args.peak_tflops)
    run_id = os.environ.get("BENCH_RUN_ID", "").strip() or uuid.uuid4().hex[:12]  # bench/gpu_check.sh: one for all
    result = {
        "command": shlex.join(sys.orig_argv), "run_id": run_id, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        **git_state(),  # BENCH_GIT_COMMIT names the commit where the machine's .git is stale
        "git_dirty_paths": dirty_paths(), "versions": versions(), "cpus": os.cpu_count(), "measures": MEASURES,
        "torch_version": torch.__version__, "python": platform.python_version(), **info, "model": args.model,
        "dry_run": args.dry_run, "sizes": size, "loadavg_at_start": os.getloadavg(), "targets": TARGETS,
        "rows": [],
    }
    kept = _earlier_rows(path, info, args) if wanted else []
    by_name = {r["name"]: r for r in kept}
    print(f"bench/gpu.py: {len(chosen)} rows on {info['device_name']} (torch {torch.__version__}) -> {path}")
    for row in chosen:
        start = time.perf_counter()
        r = {"name": row.name, "what": row.what, "kind": row.kind, "overrides": list(row.sets),
             "env": dict(row.env), "run_id": run_id, "git_commit": result["git_commit"], "date": result["date"],  # rows merge
             **measure(row, args, size, data, device)}
        if "median_step_s" in r:
            peak = info["peak_tflops"]
            r["mfu"] = r["flops_per_token"] * r["tokens_per_s"] / (peak * 1e12) if peak else None
            r["plan_ratio"] = r["planned_bytes"] / r["peak_bytes"] if r["planned_bytes"] else None
        r["wall_s"] = time.perf_counter() - start
        by_name[row.name] = r
        result["rows"] = [by_name[x.name] for x in rows if x.name in by_name]
        result["checks"] = checks(by_name, size)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(_line(r), flush=True)
    result["loadavg_at_end"] = os.getloadavg()
    result["plotted"] = plot(result, path.with_suffix(".png"))
    path.write_text(json.dumps(result, indent=1) + "\n")
    for key, c in result["checks"].items():
        print(f"  {key}: {check_line(c)}")
    return 0


def _earlier_rows(path: Path, info: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows of an earlier run on the same device and size, kept where this run does not measure them again."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    same = old.get("device_name") == info["device_name"] and old.get("model") == args.model
    return old.get("rows", []) if same else []


def check_line(c: dict[str, Any]) -> str:
    """One check, as the summary prints it."""
    if c["value"] is None:
        return f"null (target {c.get('target', '-')}): {c['note']}"
    return f"{c['value']:.3f} (target {c.get('target', '-')}): {'met' if c['met'] else 'NOT met'}"


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"  {r['name']:<40} ERROR {r['error'][:200]}"
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
    planned = f"{r['planned_bytes'] / 2**30:.2f}" if r.get("planned_bytes") else "-"
    return (f"  {r['name']:<40} {r['median_step_s'] * 1e3:9.1f} ms {r['tokens_per_s']:>10.0f} tok/s  MFU {mfu:>6}  "
            f"peak {r['peak_bytes'] / 2**30:.2f} GiB, planned {planned}")


if __name__ == "__main__":
    sys.exit(main())
