"""Every multi-node promise, proved across test hosts (tests/cluster/conftest.py): training with workers on two
hosts (ddp, fsdp, a pipeline whose stages sit on different hosts) against the same run on one host; a
host killed and a host cut off mid-run (one true line each, the run goes on smaller from the newest
checkpoint in the bucket, and grows back when the host returns, with no hand); `ray job submit` from
another host with the token, a wrong token refused. h2's name resolves to loopback and h3's to nothing
(scenarios.OWN_NAME): every run here also proves that gloo is given the Ray address's interface."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.cluster.netns import RATE_PROBE
from tests.cluster.scenarios import (
    EVERY,
    STEPS,
    WORKER_CPUS,
    Driver,
    console_lines,
    events,
    fault_run,
    losses,
    reference_losses,
    run_raw,
    start_train,
    write_yaml,
)

pytestmark = pytest.mark.cluster

# Two ranks on two hosts and on one host do the same arithmetic (gloo's two-rank sums are order-free); a
# resized run differs in float summation order only (tests/ray/test_elastic.py: 1.2e-7 measured).
LOSS_RTOL = 1e-5


def test_hosts_are_machines(tier):
    """The fixture's premise: own hostnames (h2's resolving to loopback, h3's to nothing), own /tmp."""
    h1, h2, h3 = (tier.hosts[n] for n in ("h1", "h2", "h3"))
    assert h1.run(["hostname"]).stdout.strip() == "h1"
    assert h2.run(["getent", "hosts", "h2"]).stdout.split()[0] == "127.0.1.1"
    assert h3.run(["getent", "hosts", "h3"], check=False).returncode != 0
    gcs_log = ["test", "-e", "/tmp/ray/session_latest/logs/gcs_server.out"]
    assert h1.run(gcs_log, check=False).returncode == 0, "the head's Ray session is in its own /tmp"
    assert h2.run(gcs_log, check=False).returncode != 0, "h2 sees h1's /tmp"
    assert h2.run(["test", "-e", "/tmp/ray/session_latest"], check=False).returncode == 0


def test_hosts_have_their_own_cpu(tier):
    """Each host runs under its own CPU quota (scenarios.TIER_CPUS/WORKER_CPUS): a busy loop in a host never gets
    more than its share, with every host busy at once (bring-up) and with one host busy alone (now, the others
    idle: without a quota it would take a whole core); and a host's processes, Ray's included, are in its cgroup."""
    assert set(tier.cpu_rates) == set(tier.hosts.names)
    for name, rate in tier.cpu_rates.items():
        assert rate["measured"] <= rate["quota"] * 1.05, f"{name} got more than its share at bring-up: {rate}"
    alone = tier.hosts["h2"].run([sys.executable, "-c", RATE_PROBE.format(seconds=1.0)])
    assert float(alone.stdout) <= WORKER_CPUS * 1.05, f"h2 alone got {alone.stdout.strip()} of a core"
    group = tier.hosts["h2"].quota.path
    raylets = [pid for pid in tier.hosts["h2"].pids() if b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert raylets, "h2 runs no raylet"
    assert all(str(pid) in (group / "cgroup.procs").read_text().split() for pid in raylets), "h2's raylet escapes its quota"


def _ranks_on_hosts(tier, class_name: str = "RayTrainWorker") -> set[str]:
    """The addresses of the hosts that ran actors of `class_name`, alive or dead (Ray's state API, asked on
    the head): by default, Train workers."""
    out = tier.python(
        "import ray; from ray.util.state import list_actors; ray.init(address='auto', log_to_driver=False); "
        "nodes = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}; "
        f"print(sorted({{nodes[a.node_id] for a in list_actors(filters=[('class_name', '=', {class_name!r})], "
        "limit=1000)}))", host="h1")
    return set(eval(out.strip().splitlines()[-1]))  # noqa: S307 - our own print of a list of strings


# Gradients all-reduced, and pipeline stages sent point to point, across hosts: gloo's two transports (an FSDP
# case, gloo's collectives again, went for CI's time; FSDP against one process: the dist tier)
@pytest.mark.parametrize("parallel", [{"engine": "ddp"}, {"engine": "fsdp", "pp": 2}], ids=["ddp", "pp2"])
def test_train_across_hosts_matches_one_host(tier, parallel):
    name = "-".join(f"{k}{v}" for k, v in parallel.items())
    run_dir = tier.new_run_dir(name)
    raw = run_raw(run_dir, parallel=parallel, scaling={"num_workers": 2})
    driver = start_train(tier, write_yaml(tier.workdir(), name, raw))
    assert driver.wait() == 0, driver.text()[-4000:]
    rows = tier.metrics(run_dir)
    got = losses(rows)
    assert list(got) == list(range(1, STEPS + 1))
    assert got == pytest.approx(reference_losses(tier, raw), rel=LOSS_RTOL)
    assert {r["world_size"] for r in rows if r.get("kind") == "train"} == {2}
    assert {tier.hosts["h2"].address, tier.hosts["h3"].address} <= _ranks_on_hosts(tier)
    assert "Traceback" not in driver.text() and "Gloo connectFullMesh failed" not in driver.text()


def _check_fault(tier, result: dict, cause: str) -> None:
    text = result["console"]
    assert result["code"] == 0, text[-4000:]
    lost = [line for line in console_lines(text) if line.startswith("raytrain: lost host h3")]
    assert len(lost) == 1, text[-4000:]
    assert f"({tier.hosts['h3'].address}): {cause}" in lost[0], lost[0]
    assert f"from step {EVERY}" in lost[0], lost[0]
    assert len([line for line in console_lines(text) if "is back in the cluster" in line]) == 1, text[-4000:]
    for noise in ("Traceback", "killed by a signal", "marked dead because", "StackTrace", "Raylet is terminated"):
        assert noise not in text, f"{noise!r} on the console:\n{text[-4000:]}"
    assert re.search(rf"resumed from step {EVERY} on 1 workers", text), text[-4000:]
    assert re.search(rf"resumed from step {2 * EVERY} on 2 workers", text), text[-4000:]

    rows = result["rows"]
    got = losses(rows)
    assert list(got) == list(range(1, STEPS + 1)), "each step once in metrics.jsonl"
    assert [(e["step"], e["world_size"]) for e in events(rows, "resume")] == [(EVERY, 1), (2 * EVERY, 2)]
    assert got == pytest.approx(reference_losses(tier, result["raw"]), rel=LOSS_RTOL)


def test_killed_host_shrinks_then_grows_back(tier):
    result = fault_run(tier, "kill")
    _check_fault(tier, result, "its Ray processes are gone")


def test_cut_off_host_is_unreachable_then_rejoins_by_itself(tier):
    result = fault_run(tier, "cut")
    _check_fault(tier, result, "unreachable")


def test_job_submit_from_the_client_host(tier):
    """`ray job submit` from a host outside the Ray cluster, the run YAML uploaded as its working dir."""
    run_dir = tier.new_run_dir("job")
    raw = run_raw(run_dir, parallel={"engine": "ddp"}, scaling={"num_workers": 2})
    job_dir = tier.workdir() / "job"
    job_dir.mkdir()
    write_yaml(job_dir, "run", raw)
    dashboard = f"http://{tier.hosts['h1'].address}:8265"
    submit = ["ray", "job", "submit", "--address", dashboard, "--working-dir", str(job_dir), "--",
              "raytrain", "train", "run.yaml", "--no-progress"]
    out = tier.hosts["client"].run(submit, env=tier.ray.env(), timeout=400, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "succeeded" in out.stdout + out.stderr
    assert list(losses(tier.metrics(run_dir))) == list(range(1, STEPS + 1))

    wrong = tier.hosts["client"].run(submit, env=tier.ray.env(RAY_AUTH_TOKEN="0" * 32), timeout=120, check=False)
    assert wrong.returncode != 0
    assert re.search(r"(?i)unauthori[sz]ed|token|authentication", wrong.stdout + wrong.stderr)

    # A driver with a wrong token joining the cluster directly: one line, exit 2, no traceback.
    train = tier.hosts["client"].run(["raytrain", "train", str(job_dir / "run.yaml"), "--address", tier.ray.address,
                                      "--no-progress"], env=tier.ray.env(RAY_AUTH_TOKEN="0" * 32), timeout=180,
                                     check=False)
    assert train.returncode == 2, train.stdout[-2000:] + train.stderr[-3000:]
    assert "the cluster refused this process's token" in train.stderr and "Traceback" not in train.stderr


def test_pbt_over_hosts_survives_a_lost_host(tier):
    """`raytrain tune` on the head: two trials of one worker each, so one trains on h2 and one on h3 (1 CPU
    each) and the first exploit copies a donor's checkpoint on one host into a run on the other, through
    the bucket. After that exploit h3 is killed, then booted again: every trial reaches its budget, each
    report once, and the lineage holds the exploit as it happened."""
    steps, interval = 40, 10
    name = f"pbt-{tier.runs}"
    tier.runs += 1
    base = run_raw("s3://tier/unused", parallel={"engine": "none"},
                   optimizer={"name": "adamw", "lr": 1e-3}, train={"steps": steps, "eval_every": interval})
    write_yaml(tier.workdir(), f"{name}-base", base)
    exp = {
        "name": name, "base": f"{name}-base.yaml", "storage": "s3://tier/tune",
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        "initial": [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        "scheduler": {"name": "pbt", "interval": interval, "burn_in": 0, "quantile_fraction": 0.5, "synch": True,
                      "resample_probability": 0.0},
        "population": 2, "budget": {"steps": steps}, "resources": {"workers": 1, "cpus_per_worker": 1},
    }
    path = write_yaml(tier.workdir(), name, exp)
    log = path.with_suffix(".console")
    driver = Driver(tier.ray.raytrain(["tune", str(path), "--address", tier.ray.address], log=log), log)
    driver.wait_line("exploit: ", timeout=300)
    tier.hosts["h3"].kill()
    driver.wait_line("raytrain: lost host h3")
    tier.hosts["h3"].start()
    tier.ray.start_worker("h3")
    code = driver.wait(600)
    text = driver.text()
    assert code == 0, text[-5000:]
    assert len([line for line in console_lines(text) if line.startswith("raytrain: lost host h3")]) == 1
    assert "Traceback" not in text, text[-5000:]

    exp_dir = f"s3://tier/tune/{name}"
    out = tier.python(
        "import json; from search.lineage import read_reports, read_events; "
        f"r = read_reports({exp_dir!r}); e = read_events({exp_dir!r}); "
        "print(json.dumps({'reports': [(x['trial'], x['step'], x['hparams']['optimizer.lr'], bool(x.get('abandoned'))) "
        "for x in r], 'events': [(x['trial'], x['donor'], x['step']) for x in e]}))")
    found = json.loads(out.strip().splitlines()[-1])
    reports = [tuple(r) for r in found["reports"] if not r[3]]
    trials = sorted({r[0] for r in reports})
    assert len(trials) == 2
    for trial in trials:
        assert sorted(r[1] for r in reports if r[0] == trial) == list(range(interval, steps + 1, interval)), \
            f"{trial}: each report once, to the budget"
    strong = next(r[0] for r in reports if r[2] == 1e-2 and r[1] == interval)
    weak = next(t for t in trials if t != strong)
    first = found["events"][0]
    assert (first[0], first[1], first[2]) == (weak, strong, interval), found["events"]
    assert len({tier.hosts["h2"].address, tier.hosts["h3"].address} & _ranks_on_hosts(tier)) == 2
    # what the driver and the trials rely on lives beside them on the head, never on a host that may go
    for actor in ("PopulationActor", "RunGate"):
        assert _ranks_on_hosts(tier, actor) == {tier.hosts["h1"].address}, actor
