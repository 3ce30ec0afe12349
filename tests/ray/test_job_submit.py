"""`ray job submit --working-dir . -- raytrain train ...` against a head started with `ray start --head` on
loopback, with token authentication on (the token in the environment of both sides, never in a file we
ship); a wrong token is refused."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from raytrain_ext.launcher import wait_for
from tests.conftest import tiny_raw
from tests.dist.harness import free_ports
from trainers.metrics import read_metrics

# the slow tier (~45 s on 2 cores: a Ray head in its own processes and a job); the cluster tier submits a job from
# a client host too
pytestmark = [pytest.mark.ray, pytest.mark.slow]

BIN = Path(sys.executable).parent


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def head():
    """A Ray head on loopback, owned by this test: stopped by its pid (SIGTERM drains and stops the
    processes it started)."""
    token = secrets.token_hex(16)
    temp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    # distinct ports, taken together: the agents' fixed default ports clash with any other Ray on this machine
    gcs, dashboard, agent_http, agent_grpc, runtime_env, metrics, client = free_ports(7)
    log = (temp / "head.log").open("w")
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
         "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", f"--temp-dir={temp / 'ray'}",
         f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
         f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
         f"--ray-client-server-port={client}"],
        env={**_env(token), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "2"}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        ready = "will now block forever"
        wait_for(lambda: ready in (temp / "head.log").read_text() or proc.poll() is not None, 120, "the Ray head")
        assert proc.poll() is None, (temp / "head.log").read_text()[-3000:]
        yield f"http://127.0.0.1:{dashboard}", token
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


NOT_READY = "No available agent to submit job"  # the head's job agent starts after `ray start` returns
ENDED = ("succeeded", "failed", "was stopped")  # `ray job status` on a job that ended


def _ray(token: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *argv], env=_env(token), capture_output=True, text=True, timeout=400)


def _submit(address: str, token: str, workdir: Path, job_id: str, *argv: str) -> subprocess.CompletedProcess:
    """`ray job submit --no-wait`, repeated while the head says its job agent is not up yet (its own advice).
    Not the CLI's own log tail: a WebSocket that Ray 2.60 ends with an error whenever its connection drops
    (close code 1006, ray-project/ray#57002), whatever the job does; the job's end is read by `_ended`."""
    deadline = time.monotonic() + 180
    while True:
        out = _ray(token, "job", "submit", f"--address={address}", f"--working-dir={workdir}",
                   f"--submission-id={job_id}", "--no-wait", "--", *argv)
        if NOT_READY not in out.stdout + out.stderr or time.monotonic() > deadline:
            return out
        time.sleep(1)


def _ended(address: str, token: str, job_id: str) -> tuple[str, str]:
    """Waits for the job to end (`ray job status`, plain HTTP); its status line and whole log (`ray job logs`)."""
    status = ""

    def ended() -> bool:
        nonlocal status
        done = _ray(token, "job", "status", job_id, f"--address={address}")
        status = done.stdout + done.stderr
        return any(f"'{job_id}' {word}" in status for word in ENDED)

    wait_for(ended, 400, f"job {job_id} to end", poll_s=2.0)  # each poll is a `ray` process
    return status, _ray(token, "job", "logs", job_id, f"--address={address}").stdout


def test_ray_job_submit_runs_raytrain_train(head, corpus_dir, tmp_path):
    address, token = head
    workdir = tmp_path / "project"
    workdir.mkdir()
    run_dir = tmp_path / "runs" / "job"
    raw = tiny_raw(corpus_dir, run_dir, parallel={"engine": "ddp"}, scaling={"num_workers": 2},
                   train={"steps": 6, "eval_every": 3}, checkpoint={"every": 3})
    (workdir / "run.yaml").write_text(yaml.safe_dump(raw))

    refused = _submit(address, "not-the-token", workdir, "refused", "raytrain", "train", "run.yaml")
    assert refused.returncode != 0 and "invalid authentication token" in (refused.stdout + refused.stderr).lower()

    out = _submit(address, token, workdir, "train", "raytrain", "train", "run.yaml", "--no-progress")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    status, logs = _ended(address, token, "train")
    assert "'train' succeeded" in status and "done: step 6" in logs, (status + logs)[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, 7)) and {r["world_size"] for r in rows} == {2}
    assert (run_dir / "checkpoints" / "step_00000006" / "COMMITTED").is_file()
