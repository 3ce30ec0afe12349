"""Ray across test hosts (tests/cluster/netns.py): an S3-compatible server on a host of its own, a Ray head on
h1, Ray workers on h2 and h3, and a client host, all with token authentication, nothing shared but the
machine's read-only software (this checkout and its virtualenv, as an image would be).

Each worker host's Ray runs as a service manager would run it (systemd's `Restart=always` around
`ray start --block`): when its raylet exits (the GCS declared the node dead after a partition) it starts
again and the host rejoins. Ray's health checks are the ones `clusters/local.yaml` sets (`HEALTH_CHECKS`,
read from that file), so the tier measures what the cluster files give.
"""

from __future__ import annotations

import re
import secrets
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.cluster.netns import Host, TestHosts

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
S3_PORT = 9000
RAY_PORT = 6379
DASHBOARD_PORT = 8265
CLUSTER_FILE = ROOT / "clusters" / "local.yaml"
NAMES = ("h1", "h2", "h3", "s3", "client")
WORKERS = ("h2", "h3")


def health_checks(path: Path = CLUSTER_FILE) -> dict[str, str]:
    """The `RAY_health_check_*` settings the cluster file's head start command exports."""
    raw = yaml.safe_load(path.read_text())
    text = " ".join(raw["head_start_ray_commands"])
    return dict(re.findall(r"(RAY_health_check_\w+)=(\d+)", text))


@dataclass
class RayHosts:
    hosts: TestHosts
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    logs: Path | None = None
    started_s: float = 0.0
    workers: tuple[str, ...] = WORKERS  # the hosts with a Ray worker node

    @property
    def head(self) -> Host:
        return self.hosts["h1"]

    @property
    def address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.hosts['s3'].address}:{S3_PORT}"

    def env_health(self) -> dict[str, str]:
        return health_checks()

    def env(self, **extra: str) -> dict[str, str]:
        """The environment every process on a host gets (a node's service environment)."""
        env = {
            "PATH": f"{VENV_BIN}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(ROOT),
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAYTRAIN_CACHE": "/tmp/raytrain-cache",
            "OMP_NUM_THREADS": "1",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_ENDPOINT_URL": self.s3_endpoint,
            **health_checks(),
        }
        env.update(extra)
        return env

    # ------------------------------------------------------------------------------------------- start
    def up(self) -> RayHosts:
        t0 = time.monotonic()
        self.logs = self.hosts.workdir / "logs"
        self.logs.mkdir()
        self._start_s3()
        self.start_head()
        for i, name in enumerate(self.workers):
            self.start_worker(name)
            self.wait_nodes(i + 2)
        self.started_s = time.monotonic() - t0
        return self

    def _start_s3(self) -> None:
        code = ("from moto.server import ThreadedMotoServer; import threading; "
                f"s = ThreadedMotoServer(ip_address='0.0.0.0', port={S3_PORT}, verbose=False); s.start(); "
                "print('serving', flush=True); threading.Event().wait()")
        self.hosts["s3"].popen([sys.executable, "-c", code], env=self.env(), log=self.logs / "s3.log")
        self.python("client", "from tests.cluster.probe import wait_tcp; "
                    f"wait_tcp('{self.hosts['s3'].address}', {S3_PORT}, 60)")

    def start_head(self) -> None:
        self.head.run(["ray", "start", "--head", f"--node-ip-address={self.head.address}", f"--port={RAY_PORT}",
                       "--num-cpus=0", "--memory=2000000000", "--object-store-memory=150000000",
                       "--dashboard-host=0.0.0.0", f"--dashboard-port={DASHBOARD_PORT}", "--disable-usage-stats"],
                      env=self.env(), timeout=180)

    def start_worker(self, name: str) -> None:
        """Ray on a worker host under a restart loop (systemd's Restart=always around `ray start --block`)."""
        host = self.hosts[name]
        start = shlex.join(["ray", "start", f"--address={self.address}", f"--node-ip-address={host.address}",
                            "--num-cpus=1", "--memory=3000000000", "--object-store-memory=150000000",
                            "--disable-usage-stats", "--block"])
        host.popen(["bash", "-c", f"while :; do {start}; sleep 1; done"], env=self.env(),
                   log=self.logs / f"{name}-ray.log")

    def python(self, host: str, code: str, timeout: float = 300, check: bool = True, **env: str):
        return self.hosts[host].run([sys.executable, "-c", code], env=self.env(**env), timeout=timeout,
                                    check=check, cwd=str(ROOT))

    def wait_nodes(self, count: int, timeout: float = 180) -> None:
        """Until `count` nodes are alive (asked of the GCS from the head)."""
        self.python("h1", f"from tests.cluster.probe import wait_nodes; wait_nodes('{self.address}', {count}, "
                    f"{timeout})", timeout=timeout + 60)

    def raytrain(self, argv: Sequence[str], host: str = "h1", log: Path | None = None, **env: str):
        """`raytrain ARGV` on a host (the head by default, as a job's driver runs), in the background."""
        return self.hosts[host].popen([str(VENV_BIN / "raytrain"), *argv], env=self.env(**env), cwd=str(ROOT),
                                      log=log)

