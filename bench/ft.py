"""Per-step fault tolerance (torchft replica groups) beside today's restart path, in one run of this script.

    python bench/ft.py --data data/stdlib                      # a 10-minute soak per path (~25 min in all)
    python bench/ft.py --data data/stdlib --minutes 3 --every 30
    python bench/ft.py --data data/stdlib --kill-only        # the kill alone (~3 min): the JSON's kill fields
                                                             # and `kill.provenance`; the soaks' kept as they were

Every run is `raytrain train` in a fresh process (a local Ray), three workers of one CPU-sized tiny model:
- **kill**: per-step fault tolerance, the worker of replica group 1 SIGKILLed once the run is warm. From each
  process's committed-step times (`StepTimes`, written by the workers): `survivor_max_step_gap_s`, the longest
  gap between two committed steps of a group that was not killed, from the kill to the end (the pause and the
  replacement's heal; `survivor_max_step_gap_whole_run_s` counts the start's joins too);
  `back_at_full_size_s`, from the kill to the first step trained by three groups again (Ray notices the loss,
  starts a worker, it imports, joins and heals); `heal_s` (the transfer, from the `healed` event).
- **soak**, both paths under the same schedule: a worker (groups in turn) SIGKILLed every `--every` seconds for
  `--minutes`, then Ctrl-C. `goodput` (per-step) and `restart_goodput` (`fault_tolerance: none`: the group
  restarts from its newest checkpoint, every 10 steps): committed steps x their median time at full size
  over the wall time (`raytrain_ext.result.goodput`).

Here the "host" is a worker process on this machine (the cluster tier's hosts are not used: `bench/cluster.py`
has them); a kill closes its sockets at once, as a lost host's kernel does not (a cut-off host is waited for up
to torchft's 30 s timeout). Writes bench/results/ft.json (+ ft.png) with the command, commit and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from provenance import provenance  # noqa: E402

from raytrain_ext.result import summarize  # noqa: E402
from trainers.metrics import read_metrics  # noqa: E402
from trainers.trainer import Trainer, TrainerCallback  # noqa: E402

BIN = Path(sys.executable).parent
GROUPS = 3


class StepTimes(TrainerCallback):
    """In each worker: its pid at the start (pids/<group or rank>), and a line per committed step."""

    def on_fit_start(self, trainer: Trainer) -> None:
        who = os.environ.get("RAYTRAIN_REPLICA_GROUP") or f"rank{os.environ.get('RANK', '0')}"
        folder = trainer.run_dir / "pids"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / who).write_text(str(os.getpid()))
        self.out = open(trainer.run_dir / "pids" / f"steps-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.out.write(json.dumps({"step": trainer.step, "time": time.time()}) + "\n")


def _command(data: str, run_dir: Path, per_step: bool, steps: int) -> list[str]:
    sets = [f"data.path={data}", f"run_dir={run_dir}", f"train.steps={steps}", "checkpoint.every=10",
            "train.eval_every=0", "train.tensorboard=false", "train.global_batch_size=24", "train.micro_batch_size=4",
            "parallel.engine=ddp", f"scaling.num_workers={GROUPS}", "scaling.cpus_per_worker=0.5",
            "scaling.max_failures=-1", f"scaling.fault_tolerance={'per_step' if per_step else 'none'}"]
    return [str(BIN / "raytrain"), "train", str(ROOT / "examples" / "tiny-dense.yaml"), "--no-progress",
            "--callback", "bench.ft:StepTimes", *[a for s in sets for a in ("--set", s)]]


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def _steps(run_dir: Path) -> int:
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    return rows[-1]["step"] if rows else 0


def _kill(run_dir: Path, who: str) -> tuple[int, float]:
    pid = int((run_dir / "pids" / who).read_text())
    os.kill(pid, signal.SIGKILL)  # a worker of the run this script started, by its pid
    return pid, time.time()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C of the command this script started
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def one_kill(data: str, work: Path, warm_steps: int = 30, steps: int = 400) -> dict[str, Any]:
    run_dir = work / "kill"
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = _start(_command(data, run_dir, True, steps), work / "kill.log")
    try:
        _wait_for(lambda: _steps(run_dir) >= warm_steps, 600, f"step {warm_steps}", proc)
        killed, at = _kill(run_dir, "1")
        proc.wait(1800)
    finally:
        _stop(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"the run failed (exit {proc.returncode}); see {work / 'kill.log'}")
    lines = {}
    for path in (run_dir / "pids").glob("steps-*.jsonl"):
        lines[int(path.stem.split("-")[1])] = [json.loads(x) for x in path.read_text().splitlines()]
    survivors = [pid for pid, rows in lines.items() if pid != killed and rows and rows[0]["time"] < at
                 and rows[-1]["step"] == steps]
    # After the kill: the pause it caused and the replacement's heal (the start's joins are not the kill's).
    gaps = [b["time"] - a["time"] for pid in survivors for a, b in zip(lines[pid], lines[pid][1:]) if b["time"] > at]
    whole = [b["time"] - a["time"] for pid in survivors for a, b in zip(lines[pid], lines[pid][1:]) if a["step"] >= 5]
    rows = read_metrics(run_dir / "metrics.jsonl")
    back = next(r for r in rows if r.get("kind") == "train" and r["time"] > at and r.get("replicas") == GROUPS)
    healed = [r for r in rows if r.get("event") == "healed" and r["time"] > at]
    return {
        "survivor_max_step_gap_s": round(max(gaps), 3),
        "survivor_max_step_gap_whole_run_s": round(max(whole), 3),  # from step 5: the start's joins too
        "survivors": len(survivors),
        "back_at_full_size_s": round(back["time"] - at, 3),
        "heal_s": healed[0]["heal_s"] if healed else None,
        "killed_at_step": next(r["step"] for r in rows if r.get("kind") == "train" and r["time"] > at) - 1,
        "steps": steps,
        "step_time_s_median": sorted(r["step_time_s"] for r in rows if r.get("kind") == "train")[steps // 2],
        # what a quorum costs every step (a round trip to the lighthouse, healing included where there was one)
        "quorum_s_median": sorted(r["quorum_s"] for r in rows if r.get("kind") == "train")[steps // 2],
    }


def soak(data: str, work: Path, per_step: bool, minutes: float, every_s: float) -> dict[str, Any]:
    name = "soak-ft" if per_step else "soak-restart"
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    proc = _start(_command(data, run_dir, per_step, 1_000_000), work / f"{name}.log")
    kills = []
    try:
        _wait_for(lambda: _steps(run_dir) >= 12, 600, "step 12", proc)  # warm, one checkpoint committed
        start = time.time()
        while time.time() - start < minutes * 60:
            time.sleep(max(0.0, start + (len(kills) + 1) * every_s - time.time()))  # the schedule's pace
            if time.time() - start >= minutes * 60:
                break
            who = str(len(kills) % GROUPS) if per_step else f"rank{len(kills) % GROUPS}"
            try:
                kills.append(_kill(run_dir, who)[1] - start)
            except (ProcessLookupError, FileNotFoundError):  # that one is still being replaced
                kills.append(None)
    finally:
        _stop(proc)
    result = summarize(run_dir)
    return {"goodput": result.goodput, "steps": result.step, "kills": len([k for k in kills if k is not None]),
            "minutes": minutes, "every_s": every_s}


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = ["per-step (torchft)", "restart from checkpoint"]
    ax.bar(names, [result["goodput"] or 0, result["restart_goodput"] or 0], color=["tab:green", "tab:gray"])
    ax.axhline(0.85, color="tab:red", ls="--", lw=1)
    ax.set_ylim(0, 1)
    ax.set_ylabel("goodput")
    ax.set_title(f"a worker killed every {result['soak']['every_s']:.0f} s for {result['soak']['minutes']:g} min",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a prepared corpus (make data)")
    p.add_argument("--minutes", type=float, default=10.0, help="each soak's length")
    p.add_argument("--every", type=float, default=60.0, help="seconds between kills in a soak")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--kill-only", action="store_true",
                   help="measure the kill again; keep the soaks of the results file (each part says its commit)")
    args = p.parse_args()
    started, load = time.time(), os.getloadavg()
    work = ROOT / "bench" / "_work" / "ft"
    work.mkdir(parents=True, exist_ok=True)
    data = str(Path(args.data).resolve())
    out = Path(args.out)
    kill = one_kill(data, work)
    print("kill:", json.dumps(kill), flush=True)
    if args.kill_only:
        result = json.loads((out / "ft.json").read_text())
        soak_provenance = result["soak"].get("provenance") or {
            k: result[k] for k in ("command", "date", "git_commit", "loadavg_before", "loadavg_after") if k in result}
        kill["provenance"] = provenance(started, load)
        result.update(_kill_fields(kill), kill=kill)
        result["soak"]["provenance"] = soak_provenance
        return _write(result, out)
    ft = soak(data, work, True, args.minutes, args.every)
    print("soak, per-step:", json.dumps(ft), flush=True)
    restart = soak(data, work, False, args.minutes, args.every)
    print("soak, restart:", json.dumps(restart), flush=True)
    result = {
        **_kill_fields(kill),
        "goodput": ft["goodput"],
        "restart_goodput": restart["goodput"],
        "targets": {"survivor_max_step_gap_s": 3.0, "back_at_full_size_s": 20.0, "goodput": 0.85},
        "kill": kill,
        "soak": {**ft, "restart": restart},
        "hosts": "a local Ray on this machine; a 'lost host' is a SIGKILLed worker process (not the cluster tier)",
        **provenance(started, load),
    }
    return _write(result, out)


def _kill_fields(kill: dict[str, Any]) -> dict[str, float]:
    """The JSON's headline fields that the kill measures."""
    return {k: kill[k] for k in ("survivor_max_step_gap_s", "back_at_full_size_s")}


def _write(result: dict[str, Any], out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ft.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "ft.png")
    print(json.dumps({k: result[k] for k in ("survivor_max_step_gap_s", "back_at_full_size_s", "goodput",
                                             "restart_goodput")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
