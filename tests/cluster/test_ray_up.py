"""`ray up` of the on-prem cluster file over SSH to test hosts, as a user runs it from their own machine.

Hosts of their own (prefix "rtu": the tier's Ray stays untouched), each with Debian's sshd started by the
fixture, a home folder of its own (the key in ~/.ssh/authorized_keys, the bucket's credentials and endpoint
in ~/.aws as a node's profile would hold them) and a prepared environment (`~/raytrain-venv` is this
checkout's virtualenv, as a machine image would have it: the hosts reach no package index). The client host
runs `RAY_UP_enable_autoscaler_v2=0 ray up clusters/local.yaml` (as the file's header says: Ray 2.60's
autoscaler v2 launched one of the two worker hosts, then lost track of the head) with only the hosts'
addresses and the SSH user and key changed: its setup
commands (idempotent: they reuse the prepared environment), file mounts (the repository, the token) and
start commands (`ray stop` there ends only that host's Ray: each host is its own PID namespace) run as
written. Then a job is submitted on the head (its dashboard is on loopback: what the README's SSH tunnel
reaches), trains with workers on both worker hosts into the bucket, and `ray down` ends it.
"""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest
import yaml

from tests.cluster.netns import TestHosts, can_make_hosts
from tests.cluster.ray_hosts import CLUSTER_FILE, NAMES, ROOT, S3_PORT, VENV_BIN
from tests.cluster.scenarios import STEPS, losses, run_raw, write_yaml

pytestmark = pytest.mark.cluster

BUCKET = "rayup"


def _need_ssh() -> str | None:
    missing = [tool for tool in ("sshd", "rsync", "ssh-keygen") if shutil.which(tool) is None
               and not (tool == "sshd" and shutil.which("/usr/sbin/sshd"))]
    return f"`ray up` over SSH needs {', '.join(missing)} (apt-get install openssh-server rsync)" if missing else None


@pytest.fixture(scope="module")
def ssh_hosts():
    why = can_make_hosts() or _need_ssh()
    if why is not None:
        pytest.skip(f"cluster tier skipped: {why}")
    hosts = TestHosts(NAMES, prefix="rtu").up()
    try:
        _prepare(hosts)
        yield hosts
    finally:
        hosts.down()
        left = hosts.leftovers()
        assert not left, f"the ray up test left these behind: {left}"


def _prepare(hosts: TestHosts) -> None:
    work = hosts.workdir
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
    _mkdir(hosts["client"].home / ".ssh")
    hosts["client"].run([*keygen, "-f", "/root/.ssh/id_ed25519"])
    host_key = work / "ssh_host_ed25519_key"
    hosts["client"].run([*keygen, "-f", str(host_key)])
    authorized = (hosts["client"].home / ".ssh" / "id_ed25519.pub").read_text()
    s3 = f"http://{hosts['s3'].address}:{S3_PORT}"
    (work / "sshd_config").write_text(
        f"HostKey {host_key}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPidFile /tmp/sshd.pid\n"
        "Subsystem sftp internal-sftp\n")
    for name in ("h1", "h2", "h3"):
        host = hosts[name]
        _mkdir(host.home / ".ssh")
        (host.home / ".ssh" / "authorized_keys").write_text(authorized)
        _mkdir(host.home / ".aws")
        (host.home / ".aws" / "credentials").write_text(
            "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
        (host.home / ".aws" / "config").write_text(f"[default]\nregion = us-east-1\nendpoint_url = {s3}\n")
        (host.home / "raytrain-venv").symlink_to(VENV_BIN.parent)  # the prepared image's environment
        host.run(["mkdir", "-p", "/run/sshd"])
        host.popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(work / "sshd_config")], log=work / f"{name}-sshd.log")
    code = ("from moto.server import ThreadedMotoServer; import threading; "
            f"s = ThreadedMotoServer(ip_address='0.0.0.0', port={S3_PORT}, verbose=False); s.start(); "
            "threading.Event().wait()")
    hosts["s3"].popen([sys.executable, "-c", code], log=work / "s3.log")
    _client(hosts, [sys.executable, "-c", f"from tests.cluster.probe import wait_tcp; wait_tcp("
                    f"'{hosts['s3'].address}', {S3_PORT}, 60); "
                    + "; ".join(f"wait_tcp('{hosts[n].address}', 22, 60)" for n in ("h1", "h2", "h3"))])
    _client(hosts, [sys.executable, "-c", f"import boto3; boto3.client('s3', endpoint_url='{s3}', "
                    f"aws_access_key_id='testing', aws_secret_access_key='testing', region_name='us-east-1')"
                    f".create_bucket(Bucket='{BUCKET}')"])
    _client(hosts, [str(VENV_BIN / "ray"), "get-auth-token", "--generate"])


def _mkdir(path) -> None:
    path.mkdir(mode=0o700, exist_ok=True)


def _env() -> dict[str, str]:
    return {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root", "LANG": "C.UTF-8",
            "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}


def _client(hosts: TestHosts, argv, timeout: float = 300, check: bool = True):
    return hosts["client"].run(argv, env=_env(), timeout=timeout, check=check, cwd=str(ROOT))


def test_ray_up_the_on_prem_file_submit_and_down(ssh_hosts):
    hosts = ssh_hosts
    raw = yaml.safe_load(CLUSTER_FILE.read_text())
    raw["provider"]["head_ip"] = hosts["h1"].address
    raw["provider"]["worker_ips"] = [hosts["h2"].address, hosts["h3"].address]
    raw["auth"] = {"ssh_user": "root", "ssh_private_key": "~/.ssh/id_ed25519"}
    cluster_file = hosts.workdir / "local.yaml"
    cluster_file.write_text(yaml.safe_dump(raw, sort_keys=False))

    up = _client(hosts, ["env", "RAY_UP_enable_autoscaler_v2=0", "ray", "up", "-y", "--no-config-cache",
                         str(cluster_file)], timeout=600, check=False)
    assert up.returncode == 0, (up.stdout + up.stderr)[-6000:]

    head = hosts["h1"]
    head_env = {**_env(), "PATH": f"/root/raytrain-venv/bin:{_env()['PATH']}", "RAY_AUTH_MODE": "token"}
    head.run([sys.executable, "-c", "from tests.cluster.probe import wait_nodes; wait_nodes('auto', 3, 240)"],
             env=head_env, timeout=300, cwd=str(ROOT))

    run_dir = f"s3://{BUCKET}/runs/job"
    job = run_raw(run_dir, data="/root/data/stdlib", parallel={"engine": "ddp"}, scaling={"num_workers": 2})
    job_dir = hosts.workdir / "job"
    job_dir.mkdir()
    write_yaml(job_dir, "run", job)
    submit = head.run(["ray", "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", str(job_dir),
                       "--", "raytrain", "train", "run.yaml", "--no-progress"], env=head_env, timeout=400, check=False)
    assert submit.returncode == 0 and "succeeded" in submit.stdout + submit.stderr, (submit.stdout + submit.stderr)[-5000:]
    metrics = head.run([sys.executable, "-c", "import sys; from trainers.storage import read_bytes, location; "
                        f"sys.stdout.write(read_bytes(location('{run_dir}/metrics.jsonl')).decode())"],
                       env=head_env, cwd=str(ROOT)).stdout
    rows = [json.loads(line) for line in metrics.splitlines() if line]
    assert list(losses(rows)) == list(range(1, STEPS + 1))
    assert {r["world_size"] for r in rows if r.get("kind") == "train"} == {2}

    down = _client(hosts, ["ray", "down", "-y", str(cluster_file)], timeout=300, check=False)
    assert down.returncode == 0, (down.stdout + down.stderr)[-4000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_ray_processes(hosts[n]) for n in ("h1", "h2", "h3")):
        time.sleep(0.5)
    assert not any(_ray_processes(hosts[n]) for n in ("h1", "h2", "h3")), "ray down left Ray running"


def _ray_processes(host) -> list[str]:
    out = host.run(["ps", "-eo", "args"], check=False).stdout.splitlines()
    return [line for line in out if "raylet" in line or "gcs_server" in line]
