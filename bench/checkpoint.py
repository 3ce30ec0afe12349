"""Checkpoint cost, sync vs async (issue 24): what a save blocks, when it commits, what the checksums and a
restore cost, and what saving every N steps costs a run's throughput.

One process drives our Trainer (no Ray: it runs on a GPU box without it) through segments of 3N steps that
save at steps N, 2N and 3N: `none` (no periodic save), `sync` and `async`, interleaved round after round so
that this machine's drift falls on the three alike. The first save of a segment (a new Trainer) allocates
the staging buffers: it is reported apart (`first_blocking_s`); a run reuses them for every later save. A
segment's training window runs from the record of step 2N (just before its second save) to the record of
step 3N, plus the wait its last save had for the one before it: so it holds one steady-state save and
everything that save cost training (blocking, and on a CPU the writer's share of the cores).
throughput_ratio = window(none) / window(mode), the median over rounds. Each segment is then
resumed once (a new Trainer on its run dir): its `resume` event gives restore_s and verify_s.

Two CPU shapes: `cpu-lm`, a run-like one (21M parameters, 1,024 tokens a step: 12 KB of state per token
trained between saves every 20 steps, near the 8 KB of issue 24's 1.1B run on a GPU saving every 100 steps),
which the throughput target is checked on; and `cpu`, a state-heavy one (127M parameters, 1.5 GB of state,
256 tokens a step: 300 KB a token), for the blocking and checksum targets, whose throughput ratio shows what
persisting that many bytes costs this machine's two cores. `io_floor` records that cost apart: a plain
write + fsync of 1 GiB, its CPU seconds (on this VM most of it kernel time: the disk's writeback is charged
to whichever thread is on the CPU, so a background writer cannot make it free).

The GPU shape, `1b` (issue 44): the 1.1B Llama-form model of issue 24 (bf16, fused AdamW, compile) and
its three targets (`checks`): a save blocks training <= 1 s, a resume's first step <= 15 s after its
process starts, and a run saving every 100 steps keeps >= 0.97 of the throughput without saves. It runs
once, most telling first, rewriting its JSON after each part: an async run of 3N steps saving at N, 2N
and 3N (blocking, and the stage/write/checksum split, of the saves after the first; throughput_ratio = N
steps at the run's own median step time before its first save, over the window from step 2N to 3N plus
the last save's wait); then a fresh process that builds the Trainer from that run dir, resumes and trains
one step (`resume_first_step_s`: from just before the process is started to that step's record, with
its import / build-and-restore / step split); then a short sync run, eager (two saves: what a sync save
blocks). Its rows (`shape` 1b) and `checks` merge into the file beside the CPU rows (under `1b`).

    python bench/checkpoint.py                      # CPU: both shapes
    python bench/checkpoint.py --device cuda        # GPU: the 1b shape (= --shape 1b)
    python bench/checkpoint.py --dry-run            # a tiny model, seconds: the script works
    python bench/checkpoint.py --dry-run --shape 1b # the 1b shape's code path on the CPU, made tiny
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from corpus import prepared  # noqa: E402
from run import environment  # noqa: E402  (bench/run.py's: command, commit, load average, versions)

from trainers.config import parse_config  # noqa: E402
from trainers.metrics import read_metrics  # noqa: E402
from trainers.trainer import Trainer, TrainerCallback  # noqa: E402

MODES = ("none", "sync", "async")
# The model and step per shape: on a CPU a run-like one and a state of >= 1.5 GB (127M parameters x 12 bytes
# of fp32 weights and AdamW moments); the 1.1B model of issue 24 on a GPU (`1b`: its own flow, `targets_run`).
SHAPES: dict[str, dict[str, Any]] = {
    "cpu-lm": dict(model=dict(dim=384, n_layers=12, n_heads=6, vocab_size=257, max_seq_len=256),
                   seq_len=256, batch=4, precision={}, compile=False),
    "cpu": dict(model=dict(dim=768, n_layers=18, n_heads=12, vocab_size=257, max_seq_len=64),
                seq_len=64, batch=4, precision={}, compile=False),
    "1b": dict(model=dict(dim=2048, n_layers=16, n_heads=16, vocab_size=32000, max_seq_len=2048),
               seq_len=2048, batch=8, precision={"dtype": "bf16"}, compile=True),
    "dry-run": dict(model=dict(dim=64, n_layers=2, n_heads=2, vocab_size=257, max_seq_len=32),
                    seq_len=32, batch=4, precision={}, compile=False),
}
# The 1b shape's targets (issue 24, checked by issue 44): seconds a steady-state save blocks training, seconds
# from a resuming process's start to its first step, throughput saving every 100 steps over none.
TARGETS_1B = {"blocking_s_max": 1.0, "resume_first_step_s_max": 15.0, "throughput_ratio_min": 0.97}
TARGET_EVERY_1B = 100
# --dry-run --shape 1b: the same flow on the CPU with the dry-run model (bf16 kept; compile off: inductor on
# two CPU cores takes minutes, and bench/gpu.py's dry run compiles already)
TINY_1B = dict(SHAPES["dry-run"], precision={"dtype": "bf16"}, compile=False)


def run_config(shape: dict[str, Any], data: Path, run_dir: Path, mode: str, every: int, device: str,
               steps: int | None = None, compile: bool | None = None, keep: int = 2,
               checkpoint: dict[str, Any] | None = None) -> Any:
    raw = {
        "name": f"ckpt-{mode}",
        "seed": 0,
        "run_dir": str(run_dir),
        "model": shape["model"],
        "data": {"path": str(data), "seq_len": shape["seq_len"]},
        "optimizer": {"name": "adamw", "lr": 3e-4, "fused": device == "cuda"},
        "schedule": {"name": "constant"},
        "precision": shape["precision"],
        "train": {"steps": steps or 3 * every, "global_batch_size": shape["batch"],
                  "micro_batch_size": shape["batch"], "eval_every": 0, "tensorboard": False,
                  "compile": shape["compile"] if compile is None else compile},
        # `none` saves once, at its end (outside the window); the others at N, 2N and 3N
        "checkpoint": {"every": 0 if mode == "none" else every, "keep": keep,
                       "mode": "sync" if mode == "none" else mode, **(checkpoint or {})},
    }
    return parse_config(raw)


def segment(shape: dict[str, Any], data: Path, work: Path, mode: str, every: int, device: str) -> dict[str, Any]:
    run_dir = work / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = run_config(shape, data, run_dir, mode, every, device)
    Trainer(cfg, progress=False).fit()
    rows = read_metrics(run_dir / "metrics.jsonl")
    at = {r["step"]: r["time"] for r in rows if r["kind"] == "train"}
    saves = [r for r in rows if r.get("event") == "checkpoint"]
    last_wait = next((s["wait_s"] for s in saves if s["step"] == 3 * every), 0.0)
    out: dict[str, Any] = {"window_s": at[3 * every] - at[2 * every] + (last_wait if mode != "none" else 0.0),
                           "saves": [s for s in saves if mode != "none"]}
    if mode != "none":  # a resume: restore + verify of the newest checkpoint
        resumed = Trainer(cfg, progress=False)
        (event,) = [r for r in read_metrics(run_dir / "metrics.jsonl", "event") if r["event"] == "resume"]
        out.update(restore_s=event["restore_s"], verify_s=event["verify_s"])
        del resumed
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1], "n": len(ordered)}


def summarize(device: str, shape_name: str, rounds: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    shape = SHAPES[shape_name]
    rows = []
    for mode in ("sync", "async"):
        first = [s for r in rounds for s in r[mode]["saves"] if s["step"] == r["every"]]
        saves = [s for r in rounds for s in r[mode]["saves"] if s["step"] > r["every"]]  # buffers reused
        ratios = [r["none"]["window_s"] / r[mode]["window_s"] for r in rounds]
        state_bytes = statistics.median(s["bytes"] for s in saves)
        rows.append({
            "device": device,
            "shape": shape_name,
            "mode": mode,
            "state_bytes": state_bytes,
            "state_bytes_per_token": state_bytes / (rounds[0]["every"] * shape["batch"] * shape["seq_len"]),
            "blocking_s": _spread([s["blocking_s"] for s in saves]),
            "first_blocking_s": statistics.median(s["blocking_s"] for s in first),
            "wait_s": _spread([s["wait_s"] for s in saves]),
            "stage_s": _spread([s["stage_s"] for s in saves]),
            "commit_s": statistics.median(s["commit_s"] for s in saves),
            "write_s": statistics.median(s["write_s"] for s in saves),
            "checksum_s": statistics.median(s["checksum_s"] for s in saves),
            "restore_s": statistics.median(r[mode]["restore_s"] for r in rounds),
            "verify_s": statistics.median(r[mode]["verify_s"] for r in rounds),
            "throughput_ratio": statistics.median(ratios),
            "throughput_ratios": ratios,
            # what one save took from training: the window's time beyond the same window without saves
            "training_lost_s": statistics.median(r[mode]["window_s"] - r["none"]["window_s"] for r in rounds),
        })
    return rows


def _heaviest(rows: list[dict[str, Any]]) -> str:
    """The shape with the largest state."""
    return max(rows, key=lambda r: r["state_bytes"])["shape"]


def verdicts(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Blocking and checksums on the largest state; the throughput on the run-like shape: the one with the
    least state saved per token trained (whatever order the shapes ran in)."""
    heavy = _heaviest(rows)
    sync, async_ = (next(r for r in rows if r["mode"] == m and r["shape"] == heavy) for m in ("sync", "async"))
    run_like = min((r for r in rows if r["mode"] == "async"), key=lambda r: r["state_bytes_per_token"])
    blocking = async_["blocking_s"]["median"] / sync["commit_s"]
    checksum = max(r["checksum_s"] / r["write_s"] for r in rows)
    return {
        "async_blocking_over_sync_save": blocking,
        "async_blocking_target": 0.10,
        "async_throughput_ratio": run_like["throughput_ratio"],
        "throughput_shape": run_like["shape"],
        "throughput_target": 0.95,
        "async_throughput_ratio_by_shape": {r["shape"]: r["throughput_ratio"] for r in rows if r["mode"] == "async"},
        "checksum_over_write": checksum,
        "checksum_target": 0.25,
        "met": blocking <= 0.10 and run_like["throughput_ratio"] >= 0.95 and checksum <= 0.25,
    }


# ------------------------------------------------------------------------------ the 1b shape (issue 44)


def _run_records(run_dir: Path) -> tuple[dict[int, float], list[dict[str, Any]]]:
    """The train records' times by step, and the checkpoint events, of a run dir's metrics.jsonl."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {r["step"]: r["time"] for r in rows if r["kind"] == "train"}, [r for r in rows if r.get("event") == "checkpoint"]


def _save_figures(steady: list[dict[str, Any]], first: dict[str, Any]) -> dict[str, Any]:
    """What the steady-state saves (staging buffers reused) blocked and took, split; the first apart."""
    return {"state_bytes": statistics.median(s["bytes"] for s in steady),
            "blocking_s": _spread([s["blocking_s"] for s in steady]),
            "first_blocking_s": first["blocking_s"],
            "first_stage_s": first["stage_s"],
            "wait_s": _spread([s["wait_s"] for s in steady]),
            "stage_s": _spread([s["stage_s"] for s in steady]),
            "write_s": statistics.median(s["write_s"] for s in steady),
            "checksum_s": statistics.median(s["checksum_s"] for s in steady),
            "commit_s": statistics.median(s["commit_s"] for s in steady),
            "saves": steady + [first]}


def _release_device() -> None:
    """What the finished Trainer held on the device (the allocator's cache, compiled graphs) goes back, so a
    resuming process beside this one has the GPU's memory."""
    import gc

    if torch.cuda.is_available():
        torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def async_run(shape: dict[str, Any], data: Path, work: Path, every: int, device: str) -> tuple[dict[str, Any], Path]:
    """3N steps saving asynchronously at N, 2N and 3N. Throughput: N steps at the median step time of the
    run's own steps N/3..N (compiled and warm, no save yet) over the window from step 2N to 3N plus the last
    save's wait for the one before it (one steady-state save and all it cost training)."""
    run_dir = work / "1b-async"
    shutil.rmtree(run_dir, ignore_errors=True)
    Trainer(run_config(shape, data, run_dir, "async", every, device, keep=1), progress=False).fit()
    _release_device()
    at, saves = _run_records(run_dir)
    gaps = [at[s] - at[s - 1] for s in range(max(2, every // 3 + 1), every + 1)]
    last_wait = next((s["wait_s"] for s in saves if s["step"] == 3 * every), 0.0)
    window, none_window = at[3 * every] - at[2 * every] + last_wait, statistics.median(gaps) * every
    first = next(s for s in saves if s["step"] == every)
    return {"device": device, "shape": "1b", "mode": "async", "every": every, "steps": 3 * every,
            **_save_figures([s for s in saves if s["step"] > every], first),
            "median_step_s_before_saves": statistics.median(gaps), "window_s": window, "none_window_s": none_window,
            "throughput_ratio": none_window / window, "training_lost_s": window - none_window}, run_dir


def sync_run(shape: dict[str, Any], data: Path, work: Path, device: str, every: int = 2) -> dict[str, Any]:
    """2 x `every` steps, eager, saving synchronously at `every` and 2 x `every`: what a sync save blocks."""
    run_dir = work / "1b-sync"
    shutil.rmtree(run_dir, ignore_errors=True)
    Trainer(run_config(shape, data, run_dir, "sync", every, device, steps=2 * every, compile=False, keep=1),
            progress=False).fit()
    _release_device()
    _, saves = _run_records(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    first = next(s for s in saves if s["step"] == every)
    return {"device": device, "shape": "1b", "mode": "sync", "every": every, "steps": 2 * every, "compile": False,
            **_save_figures([s for s in saves if s["step"] > every], first),
            "throughput_ratio": None, "resume_first_step_s": None}


class _FirstStep(TrainerCallback):
    """The time of the first step's record (after the device has finished it); then the run stops."""

    def __init__(self) -> None:
        self.at: float | None = None

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.at is None:
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
            self.at = time.time()
            trainer.request_stop("bench/checkpoint.py: the first step after a resume")


def resume_child(spec: dict[str, Any]) -> None:
    """In a fresh process (`--resume-child`): build the Trainer from the run dir (it resumes the newest
    checkpoint), train one step; write when the imports, the build (restore included) and the step ended."""
    imported = time.time()
    shape = TINY_1B if spec["dry_run"] else SHAPES["1b"]
    every = spec["every"]
    cfg = run_config(shape, Path(spec["data"]), Path(spec["run_dir"]), "async", every, spec["device"],
                     steps=3 * every + 10, keep=1, checkpoint={"every": 0, "final": False})
    first = _FirstStep()
    trainer = Trainer(cfg, callbacks=[first], progress=False)
    built, step = time.time(), trainer.step
    trainer.fit()
    Path(spec["out"]).write_text(json.dumps({"imported_at": imported, "built_at": built, "first_step_at": first.at,
                                             "resumed_at_step": step}))


def resume_in_a_fresh_process(run_dir: Path, data: Path, every: int, args: argparse.Namespace) -> dict[str, Any]:
    """`resume_first_step_s`: from just before a new Python process is started to its first step's record,
    split into the imports, the Trainer's build (the restore and verify included) and the step."""
    out = run_dir.parent / "resume-child.json"
    spec = {"run_dir": str(run_dir), "data": str(data), "every": every, "device": args.device,
            "dry_run": args.dry_run, "out": str(out)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--resume-child", json.dumps(spec)]
    reserved = torch.cuda.memory_reserved() if args.device == "cuda" else None
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.resume_timeout)
    except subprocess.TimeoutExpired:
        return {"resume_first_step_s": None, "resume_error": f"ran past --resume-timeout {args.resume_timeout} s"}
    if proc.returncode or not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
        return {"resume_first_step_s": None, "resume_error": f"exit {proc.returncode}: " + " | ".join(tail)}
    child = json.loads(out.read_text())
    (event,) = [r for r in read_metrics(run_dir / "metrics.jsonl", "event") if r["event"] == "resume"]
    return {"resume_first_step_s": child["first_step_at"] - start,
            "resume_split_s": {"start_and_imports": child["imported_at"] - start,
                               "build_restore_verify": child["built_at"] - child["imported_at"],
                               "first_step": child["first_step_at"] - child["built_at"]},
            "resumed_at_step": child["resumed_at_step"], "restore_s": event["restore_s"],
            "verify_s": event["verify_s"], "parent_reserved_bytes_at_resume": reserved}


def checks_1b(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The three targets, from the 1b rows measured so far (a target whose row is missing is left out)."""
    out: dict[str, Any] = {}
    run = next((r for r in rows if r["shape"] == "1b" and r["mode"] == "async"), None)
    if run is None:
        return out

    def add(key: str, value: float | None, target: float, at_most: bool, **more: Any) -> None:
        if value is not None:
            out[key] = {"value": value, "target": target, "met": value <= target if at_most else value >= target,
                        **more}

    add("blocking_s", run["blocking_s"]["max"], TARGETS_1B["blocking_s_max"], True,
        what="the longest steady-state async save's blocking", first_save_s=run["first_blocking_s"])
    add("resume_first_step_s", run.get("resume_first_step_s"), TARGETS_1B["resume_first_step_s_max"], True)
    add("throughput_ratio", run["throughput_ratio"], TARGETS_1B["throughput_ratio_min"], False,
        every=run["every"])
    return out


def merged(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """The results file after a 1b run: its other rows (the CPU shapes) and keys kept, its earlier 1b rows
    replaced by `result`'s, the run's own figures (environment, checks) under `1b`."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    rows = [r for r in old.get("rows", []) if r.get("shape") != "1b"] + result["rows"]
    return {**old, "rows": rows, "1b": {k: v for k, v in result.items() if k != "rows"}}


def main_1b(args: argparse.Namespace) -> int:
    if args.dry_run:  # with the GPU run's flags too (bench/gpu_check.sh --dry-run): the CPU, a tiny model
        args.device = "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/checkpoint.py --device cuda: no CUDA device here; fix: run it on a GPU, or pass --dry-run",
              file=sys.stderr)
        return 2
    if args.device == "cpu" and not args.dry_run:
        print("bench/checkpoint.py --shape 1b: the 1.1B model on a CPU takes hours; fix: --device cuda on a GPU, "
              "or --dry-run for its code path at a tiny size", file=sys.stderr)
        return 2
    shape = TINY_1B if args.dry_run else SHAPES["1b"]
    every = args.every or (4 if args.dry_run else TARGET_EVERY_1B)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("checkpoint_dry_run.json" if args.dry_run else "checkpoint.json")
    result: dict[str, Any] = {
        "environment": environment(args), "device": args.device, "dry_run": args.dry_run,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "every": every,
        "shape": shape, "targets": TARGETS_1B, "rows": [], "checks": {}}

    def write(part: str) -> None:
        result["checks"], result["parts_done"] = checks_1b(result["rows"]), [*result.get("parts_done", []), part]
        path.write_text(json.dumps(merged(path, result), indent=1, default=str) + "\n")

    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-1b-", dir=os.environ.get("BENCH_WORK"))).resolve()
    try:
        data = prepared(args.data, work / "corpus", 4_000_000)
        start = time.perf_counter()
        run, run_dir = async_run(shape, data, work, every, args.device)
        result["rows"] = [run]
        write("async")
        print(f"1b async, {3 * every} steps saving every {every}: {time.perf_counter() - start:.0f} s", flush=True)
        run.update(resume_in_a_fresh_process(run_dir, data, every, args))
        write("resume")
        print(f"1b resume in a fresh process: first step after {run['resume_first_step_s']} s "
              f"{run.get('resume_error', '')}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        result["rows"].append(sync_run(shape, data, work, args.device))
        write("sync")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for r in result["rows"]:
        print(f"1b {r['mode']:>5} on {args.device}: blocking {r['blocking_s']['median']:.3f} s (max "
              f"{r['blocking_s']['max']:.3f}, first {r['first_blocking_s']:.3f}), stage {r['stage_s']['median']:.3f} "
              f"s, write {r['write_s']:.2f} s, checksums {r['checksum_s']:.3f} s, committed after {r['commit_s']:.2f} s"
              + (f", throughput x{r['throughput_ratio']:.3f}" if r["throughput_ratio"] is not None else ""))
    print(json.dumps(result["checks"]))
    return 0


def io_floor(work: Path, gib: float = 1) -> dict[str, float]:
    """CPU seconds of a plain write + fsync of `gib` GiB in 64 MiB blocks (user, system): what persisting
    bytes costs this machine before any checkpoint code."""
    import resource

    block = os.urandom(64 << 20)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    with (work / "io-floor").open("wb") as f:
        for _ in range(max(1, round(gib * 16))):
            f.write(block)
        os.fsync(f.fileno())
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    (work / "io-floor").unlink()
    return {"gib": gib, "wall_s": wall, "user_s": after.ru_utime - before.ru_utime,
            "system_s": after.ru_stime - before.ru_stime}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heavy = _heaviest(result["rows"])
    rows = [r for r in result["rows"] if r["shape"] == heavy]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["mode"] for r in rows]
    parts = {"blocking (training waits)": [r["blocking_s"]["median"] for r in rows],
             "until committed": [r["commit_s"] for r in rows],
             "checksums": [r["checksum_s"] for r in rows],
             "restore + verify": [r["restore_s"] + r["verify_s"] for r in rows]}
    width = 0.2
    for i, (label, values) in enumerate(parts.items()):
        left.bar([x + i * width for x in range(len(rows))], values, width, label=label)
    left.set_xticks([x + 1.5 * width for x in range(len(rows))], names)
    left.set_ylabel("seconds (median)")
    gib = rows[0]["state_bytes"] / 2**30
    left.set_title(f"one save of {gib:.2f} GiB on {rows[0]['device']}")
    left.legend(fontsize=8)
    bars = result["rows"]
    right.bar([f"{r['shape']}\n{r['mode']}" for r in bars], [r["throughput_ratio"] for r in bars],
              color=["tab:red" if r["mode"] == "sync" else "tab:green" for r in bars])
    right.axhline(0.95, color="k", ls="--", lw=1, label="target 0.95")
    right.set_ylim(0, 1.05)
    right.set_title(f"throughput saving every {result['every']} steps / without")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--data", type=Path, help="a prepared corpus (default: made from the stdlib)")
    parser.add_argument("--every", type=int, default=None,
                        help="save every N steps (default 20; the 1b shape 100, its target's)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of none/sync/async segments")
    parser.add_argument("--shapes", "--shape", nargs="+", choices=sorted(SHAPES),
                        help="default: cpu-lm and cpu on a CPU, 1b on a GPU (1b runs alone)")
    parser.add_argument("--resume-timeout", type=int, default=180, help="seconds the 1b shape's resume may take")
    parser.add_argument("--resume-child", default=None, help=argparse.SUPPRESS)  # internal: resume_child
    parser.add_argument("--dry-run", action="store_true", help="a tiny model, 2 rounds: the script works")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if args.resume_child:
        resume_child(json.loads(args.resume_child))
        return 0
    default = ["dry-run"] if args.dry_run else (["cpu-lm", "cpu"] if args.device == "cpu" else ["1b"])
    shapes = args.shapes or default
    if "1b" in shapes:
        if len(shapes) > 1:
            parser.error("--shape 1b runs alone (its own flow and JSON section)")
        return main_1b(args)
    every, rounds_n = (4, 2) if args.dry_run else (args.every or 20, args.rounds)
    env = environment(args)
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=os.environ.get("BENCH_WORK")))
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in shapes}
    try:
        data = prepared(args.data, work / "corpus", 4_000_000)
        floor = io_floor(work, 1 / 16 if args.dry_run else 1)
        for i in range(rounds_n):
            for name in shapes:
                rounds[name].append({mode: segment(SHAPES[name], data, work, mode, every, args.device)
                                     for mode in MODES})
                print(f"{name} round {i + 1}/{rounds_n}: " + ", ".join(
                    f"{m} {r['window_s']:.1f}s" for m, r in rounds[name][-1].items()), flush=True)
                rounds[name][-1]["every"] = every
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [row for name in shapes for row in summarize(args.device, name, rounds[name])]
    result = {"environment": env, "loadavg_at_end": os.getloadavg(), "every": every, "rows": rows,
              "verdicts": verdicts(rows), "io_floor": floor, "rounds": rounds,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "shapes": {name: SHAPES[name] for name in shapes}}
    name = "checkpoint_dry_run" if args.dry_run else ("checkpoint" if args.device == "cpu" else "checkpoint_cuda")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    kept = {"rows": rows + [r for r in old.get("rows", []) if r.get("shape") == "1b"], "1b": old["1b"]} \
        if "1b" in old else {}  # the 1b shape's rows and section stay beside this run's
    path.write_text(json.dumps({**result, **kept}, indent=1, default=str) + "\n")
    plot(result, args.out / f"{name}.png")
    for r in rows:
        print(f"{r['shape']:>7} {r['mode']:>5}: blocking {r['blocking_s']['median']:.3f}s (p90 {r['blocking_s']['p90']:.3f}), "
              f"committed after {r['commit_s']:.2f}s, write {r['write_s']:.2f}s, checksums {r['checksum_s']:.3f}s, "
              f"restore {r['restore_s']:.2f}s + verify {r['verify_s']:.2f}s, throughput x{r['throughput_ratio']:.3f}")
    print(json.dumps(result["verdicts"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
