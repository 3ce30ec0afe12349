"""Per-step fault tolerance (torchft replica groups) beside the restart path, each beside its own run without
faults, in one run of this script on the cluster tier's test hosts (root):

    sudo .venv/bin/python bench/ft.py --hosts                         # ~50 min: the JSON README quotes
    sudo .venv/bin/python bench/ft.py --hosts --minutes 1 --control-minutes 0.5 --steady-minutes 0.5 --out /tmp/ft

The bench (`tests/cluster/`): a head (h1: Ray's GCS, the driver, torchft's lighthouse; no CPU for Train workers)
and three worker hosts (h2, h3, h4), each holding one replica group (per-step) or one Train worker (the restart
path). Every host runs under its own CPU quota (`CPUS`, a cgroup per host: tests/cluster/netns.py's CpuQuota),
read back at bring-up by a busy loop in each host (`host_cpus`); a lost host takes its share with it, so a
survivor that carries more per step is slower, as on separate machines. The shares add up to less than the
machine has. Every run is `raytrain train` on the head at the product's defaults (`scaling.allreduce_timeout_s`
included), the run dir a folder every host sees (as NFS), the model tests/conftest.py's tiny one, global batch
24, a checkpoint every 10 steps.

- **faults** (one per-step run): the host of group 1 killed (every process of it) once 30 steps were trained at
  full size, and booted again at once (its Ray starting, as a replaced spot host's); later the host of group 2
  cut off until Ray declared it lost, then its link restored. For each: `survivor_max_step_gap_s`, the longest
  gap between committed steps of the processes on the other hosts, from the fault until 10 s after the run was
  back at full size; `back_at_full_size_s`, from the host's return to the first step trained by three groups.
  The kill's are the JSON's headline fields; the cut's gap is `cut_gap_default_timeout_s` (at the default
  `scaling.allreduce_timeout_s`, 10 s: an all-reduce in flight gives up on the silent peer once the lighthouse
  stopped hearing from it).
- **four arms**, one after the other: per-step and restart (`fault_tolerance: none`: the group restarts from its
  newest checkpoint), each under the same schedule of faults (a host, h2, h3, h4 in turn, killed every `--every`
  seconds for `--minutes` and booted again at once) and each without any fault for `--control-minutes` (the
  controls). Over each arm's window (from 12 steps at full size on): `samples_per_s` (committed steps x the
  global batch over the wall time; metrics.jsonl holds each step once, a restart rewinds it) and `goodput`
  (committed steps x their median time at full size over the wall time: `raytrain_ext.result.goodput`).
  `throughput_vs_control`: each path's samples/s under faults over its own control's.
- **two steady arms**, each path without faults and without checkpoints (none due in `--steady-minutes`):
  `no_fault_cost`, the per-step one's samples/s over the restart one's, is what per-step fault tolerance costs
  when nothing fails (a quorum a step, a gradient all-reduce across groups after backward), apart from the
  checkpoints every 10 steps of the controls, which the two paths write differently (the restart path's
  collective save by every worker, per-step's by the lowest live group) and which dominate them on these hosts
  (`no_fault_cost_checkpointing`: the controls' ratio).

Writes bench/results/ft.json (+ ft.png) whole, with its provenance (bench/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from provenance import provenance  # noqa: E402

from raytrain_ext.result import goodput  # noqa: E402
from tests.cluster.scenarios import train_rows  # noqa: E402
from trainers.trainer import Trainer, TrainerCallback  # noqa: E402

GROUPS = 3
GLOBAL_BATCH = 24
HOST_WORKERS = ("h2", "h3", "h4")
HOST_NAMES = ("h1", *HOST_WORKERS, "s3", "client")
# Each host's share in cores: the worker hosts alike; the head enough for the GCS, the driver, Ray Train's
# controller and the lighthouse (the restart path's recovery runs there); the bucket and the client only serve
# the bring-up. 1.85 of 2 cores in all.
CPUS = {"h1": 0.4, "s3": 0.1, "client": 0.1, **dict.fromkeys(HOST_WORKERS, 0.45)}
# a host whose busy loop got less than this share of its quota at bring-up: the machine is busy, the bench not fair
# (refused; `--rate-floor 0` for a smoke run on a busy machine, whose JSON then says so in `host_cpus`)
RATE_FLOOR = 0.9
# the code these figures measure (bench/stale.py: stale once any of it changes)
MEASURES = ["trainers/parallel", "trainers/fault_tolerance.py", "trainers/trainer.py", "trainers/checkpoint.py",
            "raytrain_ext", "tests/cluster/netns.py", "tests/cluster/scenarios.py", "tests/cluster/ray_hosts.py",
            "bench/ft.py"]


class StepTimes(TrainerCallback):
    """In each worker: its pid and host at the start (pids/<group or rank>), and a line per committed step."""

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
    runs end, their driver being inside a test host."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def after_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.path.exists() and trainer.step >= int(self.path.read_text()):
            trainer.request_stop("bench: done")


STEADY_EVERY = 1_000_000  # the steady arms' checkpoint interval: none within their window


def _host_run(cluster: Any, name: str, per_step: bool, every: int = 10) -> tuple[Any, Path, Path]:
    from tests.cluster.scenarios import run_raw, start_train, write_yaml

    run_dir, stop = cluster.workdir() / name, cluster.workdir() / f"{name}.stop"
    raw = run_raw(str(run_dir), data=str(cluster.corpus), parallel={"engine": "ddp"},
                  scaling={"fault_tolerance": "per_step" if per_step else "none", "num_workers": GROUPS,
                           "cpus_per_worker": 1, "max_failures": -1},
                  train={"steps": 1_000_000, "eval_every": 0, "global_batch_size": GLOBAL_BATCH,
                         "micro_batch_size": 4},
                  checkpoint={"every": every, "keep": 2})
    driver = start_train(cluster, write_yaml(cluster.workdir(), name, raw), "--callback", "bench.ft:StepTimes",
                         "--callback", f"bench.ft:StopAt(path={str(stop)!r})")
    return driver, run_dir, stop


def _restarts(driver: Any) -> int:
    """How often the run's worker group restarted whole from a checkpoint (the console's "resumed from step")."""
    return driver.text().count("resumed from step")


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


def _settle(driver: Any, run_dir: Path, back: float, what: str) -> float:
    """Until the run is at full size after `back` and 10 s more; the end of the fault's window."""
    driver.wait_rows(run_dir, _full_after(back), f"full size after the {what}")
    settled = time.time() + 10
    driver.wait_rows(run_dir, lambda rows: rows[-1]["time"] > settled, "10 s more at full size")
    return settled


def host_faults(cluster: Any) -> dict[str, Any]:
    """One per-step run: the host of group 1 killed once 30 steps were trained at full size (and booted again at
    once); later the host of group 2 cut off until Ray declared it lost, then its link restored."""
    driver, run_dir, stop = _host_run(cluster, "faults", True)
    driver.wait_rows(run_dir, lambda rows: len(rows) >= 30 and _size(rows[-1]) == GROUPS, "30 steps at full size")
    host = _host_of_group(run_dir, 1)
    at = time.time()
    cluster.hosts[host].kill()
    back = _reboot(cluster, host)
    kill = _fault_figures(run_dir, host, at, back, _settle(driver, run_dir, back, "kill"))
    host = _host_of_group(run_dir, 2)
    lost = driver.text().count(f"raytrain: lost host {host}")
    at = time.time()
    cluster.hosts[host].cut()
    driver.wait_rows(run_dir, lambda rows: driver.text().count(f"raytrain: lost host {host}") > lost,
                     f"Ray to declare the cut-off {host} lost")
    cluster.hosts[host].heal()
    back = time.time()
    cut = _fault_figures(run_dir, host, at, back, _settle(driver, run_dir, back, "cut"))
    rows = train_rows(run_dir)
    _end(driver, run_dir, stop)
    return {"kill": kill, "cut": cut, "whole_restarts": _restarts(driver),
            "step_time_s_median": sorted(r["step_time_s"] for r in rows)[len(rows) // 2],
            "quorum_s_median": sorted(r["quorum_s"] for r in rows)[len(rows) // 2]}


def host_arm(cluster: Any, per_step: bool, minutes: float, every_s: float | None, steady: bool = False
             ) -> dict[str, Any]:
    """One arm: a run of either path for `minutes` from 12 steps at full size on, a host (h2, h3, h4 in turn)
    killed every `every_s` seconds and booted again at once (none killed where `every_s` is None); `steady`:
    no checkpoint due in it."""
    name = ("ft" if per_step else "restart") + ("-faults" if every_s else "-steady" if steady else "-control")
    driver, run_dir, stop = _host_run(cluster, name, per_step, STEADY_EVERY if steady else 10)
    driver.wait_rows(run_dir, lambda rows: len(rows) >= 12 and _size(rows[-1]) == GROUPS, "12 steps at full size")
    start, kills = time.time(), []
    while every_s:
        time.sleep(max(0.0, start + (len(kills) + 1) * every_s - time.time()))  # the schedule's pace
        if time.time() - start >= minutes * 60:
            break
        host = HOST_WORKERS[len(kills) % len(HOST_WORKERS)]
        cluster.hosts[host].kill()
        kills.append(round(time.time() - start, 1))
        _reboot(cluster, host)
    time.sleep(max(0.0, start + minutes * 60 - time.time()))
    end = time.time()
    rows = [r for r in train_rows(run_dir) if start <= r["time"] <= end]
    _end(driver, run_dir, stop)
    return {"samples_per_s": round(len(rows) * GLOBAL_BATCH / (end - start), 2), "goodput": goodput(rows),
            "steps": len(rows), "whole_restarts": _restarts(driver), "kills": len(kills), "kills_at_s": kills,
            "minutes": minutes, "every_s": every_s, "checkpoint_every": STEADY_EVERY if steady else 10}


def on_hosts(minutes: float, control_minutes: float, steady_minutes: float, every_s: float, rate_floor: float
             ) -> dict[str, Any]:
    from tests.cluster.netns import can_make_hosts, cgroup_kind
    from tests.cluster.scenarios import bring_up

    why = can_make_hosts() or (None if cgroup_kind() else "no cgroup cpu controller here (CPU quotas per host)")
    if why:
        raise SystemExit(f"bench/ft.py: {why}")
    cluster = bring_up(HOST_NAMES, workers=HOST_WORKERS, cpus=CPUS)
    try:
        starved = {h: r for h, r in cluster.cpu_rates.items() if r["measured"] < rate_floor * r["quota"]}
        if starved:
            raise SystemExit(f"bench/ft.py: hosts got less than {rate_floor:.0%} of their CPU quota at bring-up "
                             f"(the machine is busy; the figures would not be fair): {starved}")
        print("host cpus:", json.dumps(cluster.cpu_rates), flush=True)
        faults = host_faults(cluster)
        print("faults:", json.dumps(faults), flush=True)
        arms = {}
        for arm, per_step, every, length in (("per_step", True, every_s, minutes), ("restart", False, every_s, minutes),
                                             ("per_step_control", True, None, control_minutes),
                                             ("restart_control", False, None, control_minutes),
                                             ("per_step_steady", True, None, steady_minutes),
                                             ("restart_steady", False, None, steady_minutes)):
            arms[arm] = host_arm(cluster, per_step, length, every, steady=arm.endswith("_steady"))
            print(f"{arm}:", json.dumps(arms[arm]), flush=True)
    finally:
        cluster.hosts.down()
    return {"faults": faults, "arms": arms, "host_cpus": cluster.cpu_rates, "bring_up_s": round(cluster.bring_up_s, 1)}


def headline(hosts: dict[str, Any]) -> dict[str, Any]:
    """The JSON's headline fields from the faults and the six arms."""
    kill, arms = hosts["faults"]["kill"], hosts["arms"]
    sps = {arm: a["samples_per_s"] for arm, a in arms.items()}
    return {
        "survivor_max_step_gap_s": kill["survivor_max_step_gap_s"],
        "back_at_full_size_s": kill["back_at_full_size_s"],
        "cut_gap_default_timeout_s": hosts["faults"]["cut"]["survivor_max_step_gap_s"],
        "goodput": arms["per_step"]["goodput"],
        "restart_goodput": arms["restart"]["goodput"],
        "control_goodput": {"per_step": arms["per_step_control"]["goodput"],
                            "restart": arms["restart_control"]["goodput"]},
        "samples_per_s": sps,
        "throughput_vs_control": {"per_step": round(sps["per_step"] / sps["per_step_control"], 4),
                                  "restart": round(sps["restart"] / sps["restart_control"], 4)},
        "no_fault_cost": round(sps["per_step_steady"] / sps["restart_steady"], 4),
        "no_fault_cost_checkpointing": round(sps["per_step_control"] / sps["restart_control"], 4),
    }


TARGETS = {"survivor_max_step_gap_s": 3.0, "back_at_full_size_s": 20.0, "cut_gap_default_timeout_s": 3.0,
           "goodput": 0.85, "control_goodput.per_step": 0.97, "no_fault_cost": 0.97}


def _missed(result: dict[str, Any]) -> list[str]:
    """The targets this run missed (reported, not tuned away)."""
    missed = []
    for key, target in TARGETS.items():
        value = result
        for part in key.split("."):
            value = value[part]
        lower_is_better = key.endswith("_s")
        if value is None or (value > target if lower_is_better else value < target):
            missed.append(f"{key} {value} (target {'<=' if lower_is_better else '>='} {target})")
    return missed


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = ("per_step", "per_step_control", "per_step_steady", "restart", "restart_control", "restart_steady")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.4))
    colors = ["tab:green", "tab:olive", "yellowgreen", "tab:gray", "silver", "gainsboro"]
    labels = ["per-step\nfaults", "per-step\nno fault", "per-step\nsteady", "restart\nfaults", "restart\nno fault",
              "restart\nsteady"]
    left.bar(labels, [result["samples_per_s"][a] for a in arms], color=colors)
    left.set_ylabel("committed samples/s")
    left.set_title(f"no_fault_cost {result['no_fault_cost']:.3f}", fontsize=9)
    right.bar(labels, [result["arms"][a]["goodput"] or 0 for a in arms], color=colors)
    right.axhline(0.85, color="tab:red", ls="--", lw=1)
    right.set_ylim(0, 1.05)
    right.set_ylabel("goodput")
    every, minutes = result["arms"]["per_step"]["every_s"], result["arms"]["per_step"]["minutes"]
    right.set_title(f"a host killed every {every:.0f} s for {minutes:g} min", fontsize=9)
    fig.suptitle("test hosts with CPU quotas: " + ", ".join(f"{h} {r['quota']:g}" for h, r in
                                                         result["host_cpus"].items()), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", action="store_true", required=True,
                   help="on the cluster tier's test hosts (root; the only bench: a lost host takes its CPU with it)")
    p.add_argument("--minutes", type=float, default=10.0, help="each arm under faults: its length")
    p.add_argument("--control-minutes", type=float, default=5.0, help="each arm without faults: its length")
    p.add_argument("--steady-minutes", type=float, default=3.0,
                   help="each arm without faults or checkpoints (no_fault_cost): its length")
    p.add_argument("--every", type=float, default=60.0, help="seconds between kills in an arm under faults")
    p.add_argument("--rate-floor", type=float, default=RATE_FLOOR,
                   help="refuse to measure when a host's busy loop gets less than this share of its quota")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    started, load = time.time(), os.getloadavg()
    hosts = on_hosts(args.minutes, args.control_minutes, args.steady_minutes, args.every, args.rate_floor)
    from tests.cluster.netns import cgroup_kind

    result = {**headline(hosts), "targets": TARGETS, **hosts}
    result.update(
        missed=_missed(result),
        cgroup=cgroup_kind(),
        allreduce_timeout_s="the product's default (scaling.allreduce_timeout_s)",
        hosts="the cluster tier's test hosts (tests/cluster/: network namespaces on this machine), each under its "
              "own CPU quota (host_cpus: quota and the share a busy loop in it measured at bring-up): a head with "
              "no CPU for Train workers, three worker hosts, one replica group (or Train worker) each; a lost "
              "host is every process of it killed (then booted at once) or its link cut",
        **provenance(started, load, measures=MEASURES),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ft.json").write_text(json.dumps(result, indent=1) + "\n")
    _plot(result, out / "ft.png")
    print(json.dumps({k: result[k] for k in (*headline(hosts), "missed")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
