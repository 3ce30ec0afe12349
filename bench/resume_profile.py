"""Where a resume's first step goes, for `bench/checkpoint.py`'s `resume_first_step_s` (issue 44's 15 s target).

    python3 bench/resume_profile.py --device cuda --data CORPUS --work DIR --out OUT    (one step saved, then a
                                                                                         fresh process resumes it)
    python3 bench/resume_profile.py --dry-run --data CORPUS --work DIR --out OUT        (the tiny shape, CPU)

A run of `bench/checkpoint.py`'s 1b shape saves one checkpoint after one step (sync, uncompiled); then a new Python
process (`-X importtime`) resumes it under cProfile and trains one step, writing its timeline (start, `import
torch`, CUDA's init, `import trainers`, the Trainer's build with the restore and verify, the first step) and the
profile's top entries to OUT/resume_profile.json and .txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

START = time.time()
ROOT = Path(__file__).resolve().parents[1]


def child(spec: dict) -> None:
    marks = {"python_started": START}
    import torch

    marks["torch_imported"] = time.time()
    if spec["device"] == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")
    marks["cuda_ready"] = time.time()
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
    from checkpoint import SHAPES, TINY_1B, _FirstStep, run_config

    from trainers.trainer import Trainer

    marks["trainers_imported"] = time.time()
    shape = TINY_1B if spec["dry_run"] else SHAPES[spec["shape"]]
    cfg = run_config(shape, Path(spec["data"]), Path(spec["run_dir"]), "async", 1, spec["device"], steps=3,
                     keep=1, checkpoint={"every": 0, "final": False})
    first = _FirstStep()
    prof = cProfile.Profile()
    prof.enable()
    trainer = Trainer(cfg, callbacks=[first], progress=False)
    prof.disable()
    marks["built"] = time.time()
    trainer.fit()
    marks["first_step"] = first.at
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(25)
    Path(spec["out"], "build_profile.txt").write_text(text.getvalue())
    Path(spec["out"], "marks.json").write_text(json.dumps(marks))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data")
    ap.add_argument("--work")
    ap.add_argument("--out")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--shape", default="1b", help="a shape of bench/checkpoint.py (cpu: its 127M CPU model)")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if not (args.data and args.work and args.out):
        ap.error("--data, --work and --out are required")
    sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
    from checkpoint import SHAPES, TINY_1B, run_config
    from run import environment  # bench/run.py's: command, commit, load average, versions

    from trainers.trainer import Trainer

    env = environment(args)
    out, run_dir = Path(args.out), Path(args.work) / "resume-profile"
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY_1B if args.dry_run else SHAPES[args.shape]
    t = time.time()
    Trainer(run_config(shape, Path(args.data), run_dir, "sync", 1, args.device, steps=1, compile=False, keep=1),
            progress=False).fit()
    saved = time.time() - t
    spec = {"device": args.device, "data": args.data, "run_dir": str(run_dir), "dry_run": args.dry_run,
            "shape": args.shape, "out": str(out)}
    start = time.time()
    proc = subprocess.run([sys.executable, "-X", "importtime", __file__, "--child", json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True)
    imports = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            parts = [p.strip() for p in line.removeprefix("import time:").split("|")]
            if parts[1].isdigit():
                imports.append((int(parts[1]), parts[2]))
    top = [{"cumulative_us": us, "module": m} for us, m in sorted(imports, reverse=True)[:30]]
    if proc.returncode:
        print(proc.stderr[-3000:])
        raise SystemExit(proc.returncode)
    marks = json.loads((out / "marks.json").read_text())
    order = ["python_started", "torch_imported", "cuda_ready", "trainers_imported", "built", "first_step"]
    split = {f"{a}->{b}": marks[b] - marks[a] for a, b in zip(order, order[1:])}
    result = {"environment": env, "loadavg_at_end": os.getloadavg(), "device": args.device, "shape": args.shape, "dry_run": args.dry_run, "save_run_s": saved,
              "process_start_to_python": marks["python_started"] - start,
              "first_step_after_start_s": marks["first_step"] - start, "split_s": split, "imports_top": top}
    (out / "resume_profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("imports_top", "environment")}, indent=1))
    print("\n".join(f"{r['cumulative_us'] / 1e6:7.2f} s {r['module']}" for r in top[:15]))
    print("\n".join((out / "build_profile.txt").read_text().splitlines()[:70]))


if __name__ == "__main__":
    main()
