"""Per-step fault tolerance (torchft replica groups) beside today's restart path, in one run of this script.

    sudo .venv/bin/python bench/ft.py --hosts                   # on the cluster tier's test hosts (~30 min)
    python bench/ft.py --data data/stdlib                      # worker processes on this machine (~25 min)
    python bench/ft.py --data data/stdlib --minutes 3 --every 30
    python bench/ft.py --data data/stdlib --kill-only        # the kill alone (~3 min): the JSON's kill fields
                                                             # and `kill.provenance`; the soaks' kept as they were

`--hosts`: the cluster tier's test hosts (tests/cluster/, root): a head with no CPU for workers, where the
driver and torchft's lighthouse run, and three worker hosts of one CPU, each holding one replica group (per-step)
or one Train worker (the restart path); every run is `raytrain train` on the head, the run dir a folder every
host sees. From the workers' committed-step times (`StepTimes`, with their hosts) and metrics.jsonl:
- **faults** (one per-step run): the host of group 1 killed (every process of it) once 30 steps were trained at
  full size, and booted again at once (its Ray starting, as a replaced spot host's); later the host of group 2
  cut off until Ray declared it lost, then its link restored. For each: `survivor_max_step_gap_s`, the longest
  gap between committed steps of the processes on the other hosts, from the fault until 10 s after the run was
  back at full size; `back_at_full_size_s`, from the host's return to the first step trained by three groups.
  The kill's are the JSON's headline fields.
- **soak**, both paths under the same schedule: a host (h2, h3, h4 in turn) killed every `--every` seconds for
  `--minutes` and booted again at once; `goodput` (per-step) and `restart_goodput` (`fault_tolerance: none`:
  the group restarts from its newest checkpoint, every 10 steps), over the steps committed meanwhile: their
  count x their median time at full size over the wall time (`raytrain_ext.result.goodput`).
The figures of the local mode below (the last run of it) are kept under `local_processes`.

Without `--hosts`, every run is `raytrain train` in a fresh process (a local Ray), three workers of one CPU-sized
tiny model:
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
There a "host" is a worker process on this machine; a kill closes its sockets at once, as a lost host's kernel
does not (a cut-off host is waited for up to torchft's 30 s timeout). Writes bench/results/ft.json (+ ft.png)
with the command, commit and load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from provenance import provenance  # noqa: E402

from raytrain_ext.result import goodput, summarize  # noqa: E402
from tests.cluster.scenarios import train_rows  # noqa: E402
from trainers.metrics import read_metrics  # noqa: E402
from trainers.trainer import Trainer, TrainerCallback  # noqa: E402

BIN = Path(sys.executable).parent
GROUPS = 3


class StepTimes(TrainerCallback):
    """In each worker: its pid at the start (pids/<group or rank>), and a line per committed step (with its
    host's name: the test hosts' each differ)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        who = os.environ.get("RAYTRAIN_REPLICA_GROUP") or f"rank{os.environ.get('RANK', '0')}"
        folder = trainer.run_dir / "pids"
        folder.mkdir(parents=True, exist_ok=True)
        self.host = socket.gethostname()  # a test host numbers its own pids, afresh at each boot: a token too
        (folder / who).write_text(f"{os.getpid()} {self.host}")
        name = f"steps-{self.host}-{uuid.uuid4().hex[:8]}-{os.getpid()}.jsonl"
        self.out = open(folder / name, "a", buffering=1)  # noqa: SIM115

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.out.write(json.dumps({"step": trainer.step, "time": time.time(), "host": self.host}) + "\n")


class StopAt(TrainerCallback):
    """The run stops after the step the file `path` names, once it exists (every worker at that step): how the
    host runs end, their driver being inside a test host."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.path.exists() and trainer.step >= int(self.path.read_text()):
            trainer.request_stop("bench: done")


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
    rows = train_rows(run_dir)
    return rows[-1]["step"] if rows else 0


def _kill(run_dir: Path, who: str) -> tuple[int, float]:
    pid = int((run_dir / "pids" / who).read_text().split()[0])
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
        lines[int(path.stem.rsplit("-", 1)[1])] = [json.loads(x) for x in path.read_text().splitlines()]
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


# ------------------------------------------------------------------------ on the cluster tier's test hosts
# A head with no CPU for workers (the driver and the lighthouse), and three worker hosts of one CPU each: each
# holds one replica group (per-step) or one Train worker (the restart path). The run dir is a folder every host
# sees (as NFS), the data the tier's corpus beside it; the model is the tier's (tests/conftest.py's tiny one).
HOST_WORKERS = ("h2", "h3", "h4")
HOST_NAMES = ("h1", *HOST_WORKERS, "s3", "client")


# A step's all-reduce gives up on a silent group after this long (`scaling.allreduce_timeout_s`): the tiny model's
# all-reduce takes ~1 ms and its groups' steps ~20 ms, so 2 s is ~100 times the longest normal wait here.
ALLREDUCE_TIMEOUT_S = 2.0


def _host_run(cluster: Any, name: str, per_step: bool) -> tuple[Any, Path, Path]:
    from tests.cluster.scenarios import run_raw, start_train, write_yaml

    run_dir, stop = cluster.workdir() / name, cluster.workdir() / f"{name}.stop"
    ft = {"fault_tolerance": "per_step", "allreduce_timeout_s": ALLREDUCE_TIMEOUT_S} if per_step else {}
    raw = run_raw(str(run_dir), data=str(cluster.corpus), parallel={"engine": "ddp"},
                  scaling={**ft, "num_workers": GROUPS, "cpus_per_worker": 1, "max_failures": -1},
                  train={"steps": 1_000_000, "eval_every": 0, "global_batch_size": 24, "micro_batch_size": 4},
                  checkpoint={"every": 10, "keep": 2})
    driver = start_train(cluster, write_yaml(cluster.workdir(), name, raw), "--callback", "bench.ft:StepTimes",
                         "--callback", f"bench.ft:StopAt(path={str(stop)!r})")
    return driver, run_dir, stop


def _size(row: dict[str, Any]) -> int:
    return row.get("replicas", row.get("world_size", 1))


def _full_after(t: float):
    return lambda rows: any(_size(r) == GROUPS and r["time"] > t for r in rows)


def _end(driver: Any, run_dir: Path, stop: Path) -> None:
    stop.write_text(str(train_rows(run_dir)[-1]["step"] + 5))  # every worker stops after that step
    code = driver.wait(600)
    if code != 0:
        raise RuntimeError(f"the run failed (exit {code}):\n{driver.text()[-3000:]}")


def _reboot(cluster: Any, host: str) -> float:
    """The host booted again at once and its Ray started (as a replaced spot host's would): when it returns."""
    cluster.hosts[host].start()
    cluster.ray.start_worker(host)
    return time.time()


def _host_of_group(run_dir: Path, group: int) -> str:
    return (run_dir / "pids" / str(group)).read_text().split()[1]


def _step_lines(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Each process's lines, by "<host>-<token>-<pid>"."""
    return {p.stem.removeprefix("steps-"): [json.loads(x) for x in p.read_text().splitlines() if x]
            for p in (run_dir / "pids").glob("steps-*.jsonl")}


def _fault_figures(run_dir: Path, host: str, at: float, back: float, until: float) -> dict[str, Any]:
    """The processes on the other hosts that trained before the fault and after it: their longest gap between
    committed steps from the fault to `until`; the run back at full size after the host's return."""
    lines = _step_lines(run_dir)
    survivors = [pid for pid, rows in lines.items() if rows and rows[0]["host"] != host and rows[0]["time"] < at
                 and rows[-1]["time"] > back]
    gaps = [b["time"] - a["time"] for pid in survivors for a, b in zip(lines[pid], lines[pid][1:])
            if at < b["time"] <= until]
    rows = train_rows(run_dir)
    full = next(r for r in rows if _size(r) == GROUPS and r["time"] > back)
    return {"host": host, "survivors": sorted(lines[pid][0]["host"] for pid in survivors),
            "processes": {who: [rows[0]["step"], rows[-1]["step"]] for who, rows in lines.items()},
            "survivor_max_step_gap_s": round(max(gaps), 3),
            "host_away_s": round(back - at, 3), "back_at_full_size_s": round(full["time"] - back, 3),
            "at_step": next(r["step"] for r in rows if r["time"] > at) - 1}


def host_faults(cluster: Any) -> dict[str, Any]:
    """One per-step run: the host of group 1 killed once 30 steps were trained at full size (and booted again at
    once); later the host of group 2 cut off until Ray declared it lost, then its link restored."""
    driver, run_dir, stop = _host_run(cluster, "ft-faults", True)
    driver.wait_rows(run_dir, lambda rows: len(rows) >= 30 and _size(rows[-1]) == GROUPS, "30 steps at full size")
    host = _host_of_group(run_dir, 1)
    at = time.time()
    cluster.hosts[host].kill()
    back = _reboot(cluster, host)
    driver.wait_rows(run_dir, _full_after(back), "full size after the kill")
    settled = time.time() + 10
    driver.wait_rows(run_dir, lambda rows: rows[-1]["time"] > settled, "10 s more at full size")
    kill = _fault_figures(run_dir, host, at, back, settled)
    host = _host_of_group(run_dir, 2)
    lost = driver.text().count(f"raytrain: lost host {host}")
    at = time.time()
    cluster.hosts[host].cut()
    driver.wait_rows(run_dir, lambda rows: driver.text().count(f"raytrain: lost host {host}") > lost,
                     f"Ray to declare the cut-off {host} lost")
    cluster.hosts[host].heal()
    back = time.time()
    driver.wait_rows(run_dir, _full_after(back), "full size after the cut")
    settled = time.time() + 10
    driver.wait_rows(run_dir, lambda rows: rows[-1]["time"] > settled, "10 s more at full size")
    cut = _fault_figures(run_dir, host, at, back, settled)
    rows = train_rows(run_dir)
    _end(driver, run_dir, stop)
    return {"kill": kill, "cut": cut,
            "step_time_s_median": sorted(r["step_time_s"] for r in rows)[len(rows) // 2],
            "quorum_s_median": sorted(r["quorum_s"] for r in rows)[len(rows) // 2]}


def host_soak(cluster: Any, per_step: bool, minutes: float, every_s: float) -> dict[str, Any]:
    """A host killed every `every_s` seconds (h2, h3, h4 in turn), booted again at once, for `minutes`; the
    goodput of the steps committed meanwhile."""
    name = "soak-ft" if per_step else "soak-restart"
    driver, run_dir, stop = _host_run(cluster, name, per_step)
    driver.wait_rows(run_dir, lambda rows: len(rows) >= 12 and _size(rows[-1]) == GROUPS, "12 steps at full size")
    start, kills = time.time(), []
    while True:
        time.sleep(max(0.0, start + (len(kills) + 1) * every_s - time.time()))  # the schedule's pace
        if time.time() - start >= minutes * 60:
            break
        host = HOST_WORKERS[len(kills) % len(HOST_WORKERS)]
        cluster.hosts[host].kill()
        kills.append(round(time.time() - start, 1))
        _reboot(cluster, host)
    end = time.time()
    rows = [r for r in train_rows(run_dir) if start <= r["time"] <= end]
    _end(driver, run_dir, stop)
    return {"goodput": goodput(rows), "steps": len(rows), "kills": len(kills), "kills_at_s": kills,
            "minutes": minutes, "every_s": every_s}


def on_hosts(minutes: float, every_s: float) -> dict[str, Any]:
    from tests.cluster.netns import can_make_hosts
    from tests.cluster.scenarios import bring_up

    why = can_make_hosts()
    if why:
        raise SystemExit(f"bench/ft.py --hosts: {why}")
    cluster = bring_up(HOST_NAMES, workers=HOST_WORKERS)
    try:
        faults = host_faults(cluster)
        print("faults:", json.dumps(faults), flush=True)
        ft = host_soak(cluster, True, minutes, every_s)
        print("soak, per-step:", json.dumps(ft), flush=True)
        restart = host_soak(cluster, False, minutes, every_s)
        print("soak, restart:", json.dumps(restart), flush=True)
    finally:
        cluster.hosts.down()
    return {"faults": faults, "soak": {**ft, "restart": restart}, "bring_up_s": round(cluster.bring_up_s, 1),
            "allreduce_timeout_s": ALLREDUCE_TIMEOUT_S}


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
    what = "host" if "faults" in result else "worker"  # --hosts: the test hosts
    ax.set_title(f"a {what} killed every {result['soak']['every_s']:.0f} s for {result['soak']['minutes']:g} min",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="a prepared corpus (make data); not with --hosts (the tier's own)")
    p.add_argument("--minutes", type=float, default=10.0, help="each soak's length")
    p.add_argument("--every", type=float, default=60.0, help="seconds between kills in a soak")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--kill-only", action="store_true",
                   help="measure the kill again; keep the soaks of the results file (each part says its commit)")
    p.add_argument("--hosts", action="store_true",
                   help="on the cluster tier's test hosts (root): a host killed and one cut off, the soaks killing "
                        "hosts; the figures of worker processes on this machine are kept beside them")
    args = p.parse_args()
    started, load = time.time(), os.getloadavg()
    out = Path(args.out)
    if args.hosts:
        hosts = on_hosts(args.minutes, args.every)
        kill = hosts["faults"]["kill"]
        before = json.loads((out / "ft.json").read_text()) if (out / "ft.json").exists() else {}
        local = before.get("local_processes") or {k: v for k, v in before.items() if k != "targets"}
        result = {
            "survivor_max_step_gap_s": kill["survivor_max_step_gap_s"],
            "back_at_full_size_s": kill["back_at_full_size_s"],
            "goodput": hosts["soak"]["goodput"],
            "restart_goodput": hosts["soak"]["restart"]["goodput"],
            "targets": {"survivor_max_step_gap_s": 3.0, "back_at_full_size_s": 20.0, "goodput": 0.85},
            **hosts,
            "hosts": "the cluster tier's test hosts (tests/cluster/: network namespaces on this machine): a head with "
                     "no CPU for workers, three worker hosts of one CPU, one replica group (or Train worker) each; "
                     "a lost host is every process of it killed (then booted at once) or its link cut",
            "local_processes": local,
            **provenance(started, load),
        }
        return _write(result, out)
    if not args.data:
        p.error("--data: a prepared corpus (make data), or --hosts")
    work = ROOT / "bench" / "_work" / "ft"
    work.mkdir(parents=True, exist_ok=True)
    data = str(Path(args.data).resolve())
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
