"""The chunked loss's calls: forward + backward of `chunked_lm_loss` alone, eager (a loop over the chunks, the
CPU's path) against compiled one chunk a call and 8 chunks a call (CUDA's path, `CHUNKS_PER_CALL`), in
lockstep rounds in one process. Per variant: the median time and the peak memory of the loss's own
temporaries (CUDA: torch.cuda.max_memory_allocated over a forward; CPU: the allocator's events, profiled).

    python bench/chunk_calls.py                  CUDA: the seed's head (16,384 tokens, d 256, V 50,257, chunk
                                                 256, bf16 autocast); CPU: a tiny width, where the time is
                                                 the host's (Python, dispatch, kernel calls), inductor's C++
    python bench/chunk_calls.py --shape seed     the seed's head on the CPU too (slow: seconds a step)

Writes bench/results/chunk_calls.json, its section for the device and shape (e.g. `cuda-seed`; the others
are kept), with the command, commit and load average. On the CPU the compiled variants are forced (trainers.loss._compiles); they are
what CUDA runs.
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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402
from provenance import provenance  # noqa: E402

from trainers import loss  # noqa: E402
from trainers.metrics import allocator_peak_bytes  # noqa: E402

SHAPES = {"seed": {"tokens": 16384, "dim": 256, "vocab": 50257, "chunk": 256},
          "tiny": {"tokens": 16384, "dim": 8, "vocab": 64, "chunk": 256}}
VARIANTS = {"eager": (False, 1), "compiled-1-a-call": (True, 1), "compiled-8-a-call": (True, 8)}


def _use(variant: str) -> None:
    compiled, per_call = VARIANTS[variant]
    loss._compiles = lambda device: compiled  # noqa: ARG005 (the variant's, whatever the device)
    loss.CHUNKS_PER_CALL = per_call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: seed on CUDA, tiny on a CPU")
    p.add_argument("--rounds", type=int, default=5, help="lockstep rounds (each: every variant, in turn)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per variant per round")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args()
    started, load = time.time(), os.getloadavg()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape_name = args.shape or ("seed" if device.type == "cuda" else "tiny")
    shape = SHAPES[shape_name]
    torch.manual_seed(0)
    n, d, v, chunk = shape["tokens"], shape["dim"], shape["vocab"], shape["chunk"]
    h = torch.randn(n, d, device=device, requires_grad=True)
    w = (0.02 * torch.randn(v, d, device=device)).requires_grad_()
    t = torch.randint(0, v, (n,), device=device)

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return loss.chunked_lm_loss(h, w, t, chunk)

    def step() -> float:
        h.grad = w.grad = None
        out = forward()
        out.backward()
        return out.item()  # a sync: the step's work is done when its time is read

    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses, peaks = {}, {}
    for name in VARIANTS:  # warm up (compiles) and measure memory, one variant at a time
        _use(name)
        for _ in range(2):
            losses[name] = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            forward()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
        else:
            peaks[name] = allocator_peak_bytes(forward)
    for _ in range(args.rounds):  # lockstep: every variant in each round
        for name in VARIANTS:
            _use(name)
            for _ in range(args.steps):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    eager = statistics.median(times["eager"])
    rows = [{"variant": name, "median_s": statistics.median(times[name]),
             "vs_eager": statistics.median(times[name]) / eager, "peak_temp_bytes": peaks[name],
             "loss": losses[name], "times_s": times[name]} for name in VARIANTS]
    for r in rows:
        print(f"{r['variant']:>20}: {r['median_s'] * 1e3:8.2f} ms ({r['vs_eager']:.2f}x eager), "
              f"loss temporaries {r['peak_temp_bytes'] / 2**20:7.1f} MiB, loss {r['loss']:.5f}")
    path = Path(args.out) / "chunk_calls.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    result[f"{device.type}-{shape_name}"] = {
        **provenance(started, load), "device_name": torch.cuda.get_device_name() if device.type == "cuda" else
        "cpu", "torch_version": torch.__version__, "shape": shape, "autocast": "bf16", "rounds": args.rounds,
        "steps": args.steps, "rows": rows,
    }
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
