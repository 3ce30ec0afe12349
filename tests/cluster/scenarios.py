"""What the cluster tier and `bench/cluster.py` do on the test hosts: the tier's cluster (hosts + Ray + a
bucket with a corpus), runs started as a user starts them (`raytrain train ... --address H1:6379` on the
head), and the faults (a host killed, a host cut off) at a known point of a run.

A run is paced by tests/ray/hooks.py's HoldAtCheckpoint: it holds its workers after a committed checkpoint
at a given size, and the fault is made while it holds, so the step it resumes from is known. Files a probe
waits for live in the bucket (`held/...`); the driver's console goes to a log file the test reads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.cluster.netns import TestHosts
from tests.cluster.ray_hosts import NAMES, ROOT, WORKERS, RayHosts

BUCKET = "tier"
DATA = f"s3://{BUCKET}/data/stdlib"
STEPS, EVERY = 60, 20
# What each host's /etc/hosts says of its own name: h2 the Debian default (127.0.1.1), h3 nothing. gloo
# picks a loopback address from such a name unless the run pins it to the Ray address (every run here).
OWN_NAME = {"h2": "loopback", "h3": "none"}
# Each host's CPU share (cores; tests/cluster/netns.py's CpuQuota): a worker host half a core, so a lost one takes
# its half with it; the head (GCS, drivers, the lighthouse) as much; the bucket and the client what their probes
# need. 1.9 of the machine's 2 cores in all: each host gets its share while every other host is busy too.
TIER_CPUS = {"h1": 0.5, "s3": 0.2, "client": 0.2}
WORKER_CPUS = 0.5


@dataclass
class TierCluster:
    hosts: TestHosts
    ray: RayHosts
    corpus: Path  # the same corpus on the local disk, for the one-host reference runs
    bring_up_s: float = 0.0
    runs: int = 0
    cpu_rates: dict[str, dict[str, float]] = field(default_factory=dict)  # each host's quota and measured share

    def workdir(self) -> Path:
        return self.hosts.workdir

    def python(self, code: str, host: str = "client", timeout: float = 300) -> str:
        return self.ray.python(host, code, timeout=timeout).stdout

    def wait_key(self, uri: str, timeout: float = 240) -> None:
        """Until an object exists in the bucket (asked from the client host)."""
        self.python(f"from tests.cluster.probe import wait_key; wait_key({uri!r}, {timeout})", timeout=timeout + 60)

    def read_text(self, uri: str) -> str:
        return self.python(f"from trainers.storage import read_bytes, location; "
                           f"import sys; sys.stdout.write(read_bytes(location({uri!r})).decode())")

    def metrics(self, run_dir: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.read_text(f"{run_dir}/metrics.jsonl").splitlines() if line]

    def new_run_dir(self, name: str) -> str:
        self.runs += 1
        return f"s3://{BUCKET}/runs/{name}-{self.runs}"


def bring_up(names=NAMES, own_name=None, workers=WORKERS, cpus=None) -> TierCluster:
    """Hosts, each with its CPU share (`cpus`, cores by host; TIER_CPUS and WORKER_CPUS by default, read back by a
    busy loop in each before Ray starts), Ray with token auth (a worker node on each of `workers`), the S3 server
    on its host, a bucket with the tier's corpus."""
    t0 = time.monotonic()
    if cpus is None:
        cpus = {**{n: c for n, c in TIER_CPUS.items() if n in names}, **dict.fromkeys(workers, WORKER_CPUS)}
    hosts = TestHosts(names, cpus, OWN_NAME if own_name is None else own_name).up()
    try:
        rates = hosts.cpu_rates()
        ray = RayHosts(hosts, workers=tuple(workers)).up()
        corpus = hosts.workdir / "corpus"
        subprocess.run([str(Path(sys.executable).parent / "raytrain"), "data", "prepare", "--output", str(corpus),
                        "--max-bytes", "600000", "--no-progress"], check=True, capture_output=True, cwd=ROOT)
        ray.python("client", "import boto3; from trainers.storage import upload_folder, location; "
                   f"boto3.client('s3').create_bucket(Bucket={BUCKET!r}); "
                   f"upload_folder({str(corpus)!r}, location({DATA!r}))")
    except BaseException:
        hosts.down()
        raise
    return TierCluster(hosts, ray, corpus, bring_up_s=time.monotonic() - t0, cpu_rates=rates)


def run_raw(run_dir: str, data: str = DATA, **sections: dict[str, Any]) -> dict[str, Any]:
    """The tier's run: tests/conftest.py's tiny model, STEPS steps, a checkpoint every EVERY."""
    from tests.conftest import tiny_raw

    raw = tiny_raw(Path(data), Path(run_dir), **{
        "train": {"steps": STEPS, "eval_every": EVERY},
        "checkpoint": {"every": EVERY, "keep": 2},
        **sections,
    })
    raw["run_dir"], raw["data"]["path"] = run_dir, data
    return raw


def write_yaml(folder: Path, name: str, raw: dict[str, Any]) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@dataclass
class Driver:
    """`raytrain ARGV` on the head, its console in `log`."""

    proc: subprocess.Popen
    log: Path
    started: float = field(default_factory=time.time)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_line(self, needle: str, timeout: float = 240) -> float:
        """Until the console shows `needle`; the time it was seen."""
        _wait_for(lambda: needle in self.text() or self.proc.poll() is not None, timeout, repr(needle))
        assert needle in self.text(), f"the run ended without {needle!r}:\n{self.text()[-4000:]}"
        return time.time()

    def wait_rows(self, run_dir: Path, predicate, what: str, timeout: float = 300) -> None:
        """Until `predicate(train_rows(run_dir))` holds (a run dir every host sees); the run ending first, or
        the time running out, fails with the console's tail."""
        try:
            _wait_for(lambda: predicate(train_rows(run_dir)) or self.proc.poll() is not None, timeout, what)
        except TimeoutError as e:
            raise TimeoutError(f"{e}:\n{self.text()[-4000:]}") from None
        assert predicate(train_rows(run_dir)), f"the run ended before {what}:\n{self.text()[-4000:]}"

    def wait(self, timeout: float = 420) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the driver did not end within {timeout:.0f}s:\n{self.text()[-4000:]}") from None


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The train rows of the metrics.jsonl in a run dir every host sees ([] before the first)."""
    from trainers.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    return read_metrics(path, "train") if path.exists() else []


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def start_train(cluster: TierCluster, run_yaml: Path, *extra: str) -> Driver:
    log = run_yaml.with_suffix(".console")
    proc = cluster.ray.raytrain(["train", str(run_yaml), "--address", cluster.ray.address, "--no-progress", *extra],
                                log=log)
    return Driver(proc, log)


def console_lines(text: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


def events(rows: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("kind") == "event" and r.get("event") == name]


def losses(rows: list[dict[str, Any]]) -> dict[int, float]:
    steps = [r["step"] for r in rows if r.get("kind") == "train"]
    assert steps == sorted(set(steps)), f"each step once, in order: {steps}"
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


HOLD = "tests.ray.hooks:HoldAtCheckpoint"
HOLD_STEP = "tests.ray.hooks:HoldAtStep"


def fault_run(cluster: TierCluster, fault: str, engine: str = "ddp", hold_step: int | None = None,
              steps: int = STEPS) -> dict[str, Any]:
    """An elastic run (1..2 workers, one on h2 and one on h3) held after step EVERY's checkpoint at 2
    workers; then h3 is killed (`fault="kill"`) or cut off (`"cut"`); the run goes on at 1 worker and is
    held after step 2*EVERY; then h3 comes back (booted again and its Ray started, or its link restored:
    its Ray restarts itself) and the run grows back to 2 workers and finishes. `hold_step`: hold after that
    step instead (between checkpoints: the steps since step EVERY are recomputed). Returns what happened,
    with wall-clock times of each stage (the bench reads them)."""
    name = f"{fault}-{engine}"
    run_dir = cluster.new_run_dir(name)
    raw = run_raw(run_dir, parallel={"engine": engine},
                  scaling={"min_workers": 1, "max_workers": 2, "resize_check_s": 2, "max_failures": 5})
    raw["train"]["steps"] = steps
    run_yaml = write_yaml(cluster.workdir(), name, raw)
    first = f"{HOLD}(step={EVERY}, world=2)" if hold_step is None else f"{HOLD_STEP}(step={hold_step}, world=2)"
    held = EVERY if hold_step is None else hold_step
    driver = start_train(cluster, run_yaml, "--callback", first, "--callback", f"{HOLD}(step={2 * EVERY}, world=1)")
    h3 = cluster.hosts["h3"]
    cluster.wait_key(f"{run_dir}/held/step{held}_world2_rank0")
    cluster.wait_key(f"{run_dir}/held/step{held}_world2_rank1")
    t_fault = time.time()
    if fault == "kill":
        h3.kill()
    else:
        h3.cut()
    t_told = driver.wait_line("raytrain: lost host h3")
    cluster.wait_key(f"{run_dir}/held/step{2 * EVERY}_world1_rank0")
    t_back = time.time()
    if fault == "kill":
        h3.start()
        cluster.ray.start_worker("h3")
    else:
        h3.heal()
    t_rejoined = driver.wait_line("raytrain: host h3")
    code = driver.wait()
    rows = cluster.metrics(run_dir)
    return {"run_dir": run_dir, "code": code, "console": driver.text(), "rows": rows, "t_fault": t_fault,
            "t_told": t_told, "t_back": t_back, "t_rejoined": t_rejoined, "raw": raw, "held_step": held,
            "t_started": driver.started}


def reference_losses(cluster: TierCluster, raw: dict[str, Any], nproc: int = 2) -> dict[int, float]:
    """The same run on one host: torchrun with `nproc` processes on this machine, the corpus on its disk."""
    from tests.dist.harness import free_port

    folder = cluster.workdir() / f"reference-{cluster.runs}-{nproc}"
    local = {**raw, "run_dir": str(folder), "data": {**raw["data"], "path": str(cluster.corpus)}, "scaling": {}}
    run_yaml = write_yaml(cluster.workdir(), folder.name, local)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           "-m", "trainers", "train", str(run_yaml), "--no-progress"]
    out = subprocess.run(cmd, cwd=ROOT, env={**_plain_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line]
    return losses(rows)


def _plain_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RAY_"))}
