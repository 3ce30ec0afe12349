"""Where a GPU step's time goes: per-phase medians (the Trainer's data_s, forward_backward_s, optimizer_s) and
torch.profiler tables of one step, for bench/gpu.py's seed shape (all techniques; without the chunked loss;
compiled; bf16 eager) and bench/moe.py's Mixtral-form MoE (grouped); Chrome traces, gzipped, under $OUT
(default bench/_work/gpu/profile).

    python bench/gpu_profile.py [seed] [moe] > bench/results/gpu_profile.txt     (a CUDA machine, ~1 min)

On a CPU it runs the tiny sizes (a smoke run). Made to explain bench/results/gpu.json's seed rows and the
MoE's step (bench/results/gpu_profile.txt). Imports neither ray nor deepspeed.
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import gpu as G  # noqa: E402
import moe as M  # noqa: E402
import torch  # noqa: E402

from trainers.config import RunConfig  # noqa: E402
from trainers.trainer import Trainer, TrainerCallback  # noqa: E402

CUDA = torch.cuda.is_available()
ACTIVITIES = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if CUDA else [])
SORT = "self_cuda_time_total" if CUDA else "self_cpu_time_total"
PHASES = ("step_time_s", "data_s", "forward_backward_s", "optimizer_s")


class _Profile(TrainerCallback):
    """Keeps every step's record; profiles step `at` + 1 (after a sync), prints its tables, saves its trace."""

    def __init__(self, name: str, at: int, out: Path):
        self.name, self.at, self.out, self.prof, self.records = name, at, out, None, []

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.records.append(record)
        if CUDA:
            torch.cuda.synchronize()
        if self.at and trainer.step == self.at:
            self.prof = torch.profiler.profile(activities=ACTIVITIES)
            self.prof.__enter__()
        elif self.prof is not None:
            self.prof.__exit__(None, None, None)
            averages = self.prof.key_averages()
            print(averages.table(sort_by=SORT, row_limit=22, max_name_column_width=60))
            print(averages.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
            trace = self.out / f"{self.name}.json"
            self.prof.export_chrome_trace(str(trace))
            with trace.open("rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
                shutil.copyfileobj(f, g)
            trace.unlink()
            self.prof = None


def run(name: str, cfg: RunConfig, at: int, out: Path) -> None:
    cb = _Profile(name, at, out)
    Trainer(cfg, callbacks=[cb], progress=False).fit()
    late = cb.records[len(cb.records) // 3:]
    medians = ", ".join(f"{k} {statistics.median(r[k] for r in late) * 1e3:.1f} ms" for k in PHASES)
    print(f"## {name}: {medians}", flush=True)


def main(which: list[str]) -> None:
    out = Path(os.environ.get("OUT", str(G.WORK / "profile")))
    out.mkdir(parents=True, exist_ok=True)
    size = G.SIZES["1.1b" if CUDA else "tiny"]
    data = str(G.prepared(None, G.WORK / "corpus", 8_000_000, val_fraction=0.2))
    if "seed" in which:
        for name, sets, at in [
            ("seed-all", (*G.COMPILED, "memory.loss_chunk=256", "memory.activation_checkpointing=selective"), 15),
            ("seed-all-nochunk", (*G.COMPILED, "memory.activation_checkpointing=selective"), 0),
            ("seed-compiled", G.COMPILED, 0),
            ("seed-bf16", ("precision.dtype=bf16",), 0),
        ]:
            row = G.Row(f"seed/{name}", "trainer", sets)
            run(name, G.row_config(row, size, data, G.WORK / "runs" / name), at, out)
    if "moe" in which:
        model_name = "gpu-moe" if CUDA else "tiny-moe"
        model, batch, seq, _ = M.MODELS[model_name]
        sets = M.overrides(model_name, "grouped", "cuda" if CUDA else "cpu", 989.0)
        cfg = M.reference_config(data, batch, seq, 12, "off", str(G.WORK / "runs" / "moe"), False,  # as moe.py
                                 model.get("vocab_size", 257), sets)
        run("moe-grouped", cfg, 8, out)


if __name__ == "__main__":
    main(sys.argv[1:] or ["seed", "moe"])
