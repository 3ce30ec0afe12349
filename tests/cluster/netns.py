"""Test hosts on one Linux machine: each a network namespace with its own address, plus its own hostname,
`/etc/hosts`, `/tmp`, `/dev/shm`, home folder (`/root`) and PID namespace, so that Ray, torch and ssh see
separate machines.

Layout (`TestHosts.up()`): a "switch" namespace holds a bridge; every host's `eth0` is one end of a veth pair
whose other end is a port of that bridge. No namespace has a default route, and the root namespace has no
link to the switch: nothing sent by a host can leave the set of test hosts. Each host runs a small pid-1
(`host_init.py`) under `unshare --mount --uts --pid --fork --mount-proc`; commands enter it with `nsenter`.

Faults, as a network shows them:
- `host.kill()`: SIGKILL to the host's pid 1; the kernel ends every process of its PID namespace at once
  (a host that loses power, as far as its peers can tell: its address still answers, with refusals);
- `host.cut()` / `host.heal()`: its switch port down / up (a partition: its processes live on, unreachable);
- `host.start()`: a fresh pid 1 in the same network namespace (the host boots again).

Capacity: a host given `cpus` (cores, e.g. 0.45) runs every process of it, its pid 1's and each command entered
into it, in a cgroup of its own with that CPU quota (`CpuQuota`: the v1 `cpu` controller's `cfs_quota_us`, or v2's
`cpu.max`, whichever this machine has). Without quotas the hosts share the machine's cores and a killed host
hands its CPU to the survivors; with them a lost host takes its share with it, as on separate machines.
`TestHosts.cpu_rates()` reads each host's share back (a short busy loop in each, all at once).

Everything is named `<prefix>-<owner pid>-<name>`; `down()` ends every process of every namespace it made (by
the pids `ip netns pids` lists, never by a process name) and deletes the namespaces and cgroups; `leftovers()` lists what
remains (the tier's last check). `sweep_orphans()` removes what a killed earlier run of this module left
(its owner pid gone), so a Ctrl-C'd run never blocks the next.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "rtx"
# RFC 2544's benchmarking range: no public or private network uses it, and no route leads out of the switch.
SUBNET = "198.18.7"
INIT = Path(__file__).with_name("host_init.py")
CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
# The quota's period: a host over its share waits for the next one. 10 ms, not the kernel's default 100 ms: a host
# of a fraction of a core then runs as a slower machine, not as one that freezes for most of every 100 ms (which
# made a tiny model's ~40 ms steps lumpy).
PERIOD_US = 10_000
# in a host: a busy loop of SECONDS; its CPU time over its wall time is the share the host gets
RATE_PROBE = ("import time\nw, c = time.perf_counter(), time.process_time()\n"
              "while time.perf_counter() - w < {seconds}: pass\n"
              "print((time.process_time() - c) / (time.perf_counter() - w))")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def can_make_hosts() -> str | None:
    """None when this process can build test hosts, else why not (one line, for the skip)."""
    if sys.platform != "linux":
        return "test hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (ip netns, unshare, mount)"
    under_tmp = [p for p in (Path(sys.executable).absolute(), Path(__file__).absolute()) if p.is_relative_to("/tmp")]
    if under_tmp:  # each host mounts a tmpfs of its own on /tmp (its own /tmp/ray): this checkout is not there
        return (
            f"test hosts mount their own /tmp, where {under_tmp[0]} is not; run the tier from a checkout and "
            f"virtualenv outside /tmp (e.g. /var/tmp or a home folder)"
        )
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"test hosts need `{tool}` (Debian: apt-get install iproute2 util-linux)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def cgroup_kind() -> str | None:
    """"v2" where the unified hierarchy has the cpu controller, "v1" where the v1 `cpu` controller is mounted,
    else None (no quotas here)."""
    controllers = CGROUP_V2 / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return "v2"
    return "v1" if (CGROUP_V1 / "cpu.cfs_quota_us").exists() else None


@dataclass
class CpuQuota:
    """A cgroup of `name` whose processes together get at most `cores` of CPU time (per PERIOD_US)."""

    name: str
    cores: float
    kind: str = ""

    def __post_init__(self) -> None:
        self.kind = self.kind or cgroup_kind() or ""
        if not self.kind:
            raise RuntimeError("no cgroup cpu controller here (v1 /sys/fs/cgroup/cpu or v2 with +cpu): no CPU quotas")
        quota = int(self.cores * PERIOD_US)
        if self.kind == "v2":  # the root's children get the cpu controller
            (CGROUP_V2 / "cgroup.subtree_control").write_text("+cpu")
        self.path.mkdir(exist_ok=True)
        if self.kind == "v1":
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")

    @property
    def path(self) -> Path:
        return (CGROUP_V1 if self.kind == "v1" else CGROUP_V2) / self.name

    def join(self) -> None:
        """Moves the calling process into the group (a Popen's preexec_fn: the child and all it starts)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self, timeout_s: float = 10) -> None:
        """Once its processes are gone (a killed host's nsenter parents exit just after their children)."""
        deadline = time.monotonic() + timeout_s
        while self.path.exists():
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@dataclass
class Host:
    name: str
    ns: str
    address: str
    port: str  # its veth end on the bridge, in the switch namespace
    hosts_file: Path
    switch: str
    home: Path  # bound over /root inside the host
    init: subprocess.Popen | None = None
    pid1: int | None = None  # the host's pid 1, as the root PID namespace numbers it
    quota: CpuQuota | None = None  # its CPU share: every process of the host runs in its cgroup

    # ----------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Boot: a fresh pid 1 with its own hostname, /etc/hosts, /tmp, /dev/shm and PID namespace."""
        assert self.pid1 is None, f"{self.name} is running"
        self.init = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, "unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
             "--propagation", "private", sys.executable, str(INIT), self.name, str(self.hosts_file), str(self.home)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=self._join,
        )
        line = self.init.stdout.readline()  # the init says "ready" once its mounts are made
        if line.strip() != "ready":
            raise RuntimeError(f"host {self.name} did not boot: {line!r} {self.init.stderr.read()[-2000:]}")
        children = Path(f"/proc/{self.init.pid}/task/{self.init.pid}/children").read_text().split()
        self.pid1 = int(children[0])

    def kill(self) -> None:
        """Every process of the host ends at once (SIGKILL to its pid 1 ends its PID namespace)."""
        if self.pid1 is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid1, signal.SIGKILL)
            self.init.wait(30)
            self.init.stdout.close()
            self.init.stderr.close()
        self.pid1, self.init = None, None

    def cut(self) -> None:
        _ip("-n", self.switch, "link", "set", self.port, "down")

    def heal(self) -> None:
        _ip("-n", self.switch, "link", "set", self.port, "up")

    # ------------------------------------------------------------------------------------------ commands
    def _join(self) -> None:
        if self.quota is not None:
            self.quota.join()

    def _enter(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """nsenter into the host; in its mount namespace the working directory is `cwd` (nsenter would
        otherwise take its pid 1's, /)."""
        assert self.pid1 is not None, f"{self.name} is down"
        return ["nsenter", "-t", str(self.pid1), "-m", "-u", "-n", "-p", f"--wd={cwd or '/'}", "--", *argv]

    def run(self, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 300,
            check: bool = True, cwd: str | None = None) -> subprocess.CompletedProcess:
        out = subprocess.run(self._enter(argv, cwd), env=env, capture_output=True, text=True,
                             timeout=timeout, preexec_fn=self._join)
        if check and out.returncode != 0:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} -> {out.returncode}\n{out.stdout[-3000:]}\n"
                               f"{out.stderr[-5000:]}")
        return out

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None,
              log: Path | None = None) -> subprocess.Popen:
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        try:
            return subprocess.Popen(self._enter(argv, cwd), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=self._join)
        finally:
            if log:
                out.close()

    def pids(self) -> list[int]:
        """Every process in the host's network namespace (as the root PID namespace numbers them)."""
        out = _ip("netns", "pids", self.ns, check=False)
        return [int(p) for p in out.stdout.split()]


@dataclass
class TestHosts:
    """The switch and the hosts; `names` in order get addresses .11, .12, ... of SUBNET."""

    __test__ = False  # not a pytest test class

    names: Sequence[str]
    # each host's CPU share in cores (a cgroup quota; see the module's docstring); a host not named is uncapped
    cpus: dict[str, float] = field(default_factory=dict)
    # what each host's /etc/hosts says of its own name: "address" (a correct file), "loopback" (Debian's
    # default: 127.0.1.1) or "none" (the name resolves to nothing)
    own_name: dict[str, str] = field(default_factory=dict)
    prefix: str = PREFIX
    hosts: dict[str, Host] = field(default_factory=dict)
    workdir: Path | None = None

    def __post_init__(self) -> None:
        self.tag = f"{self.prefix}-{os.getpid()}"
        self.switch = f"{self.tag}-sw"

    def address(self, name: str) -> str:
        return f"{SUBNET}.{11 + list(self.names).index(name)}"

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def up(self) -> TestHosts:
        sweep_orphans(self.prefix)
        total = sum(self.cpus.values())
        if total >= (os.cpu_count() or 1):
            raise ValueError(f"the hosts' CPU shares add up to {total:g} cores; this machine has {os.cpu_count()}: "
                             f"keep them below it (a host would otherwise get less than its share)")
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-", dir="/var/tmp"))
        try:
            self._make_switch()
            for i, name in enumerate(self.names):
                self.hosts[name] = self._make_host(name, i)
            for host in self.hosts.values():
                host.start()
        except BaseException:
            self.down()
            raise
        return self

    def _make_switch(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _make_host(self, name: str, index: int) -> Host:
        ns, port, address = f"{self.tag}-{name}", f"p{index}", self.address(name)
        inner = f"v{os.getpid() % 100000}x{index}"  # a name unique in the root namespace for a moment
        _ip("netns", "add", ns)
        _ip("link", "add", inner, "type", "veth", "peer", "name", f"{inner}p")
        _ip("link", "set", inner, "netns", ns)
        _ip("link", "set", f"{inner}p", "netns", self.switch)
        _ip("-n", ns, "link", "set", inner, "name", "eth0")
        _ip("-n", self.switch, "link", "set", f"{inner}p", "name", port)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        hosts_file = self.workdir / f"{name}.hosts"
        hosts_file.write_text(self.hosts_text(name))
        home = self.workdir / f"{name}-home"
        home.mkdir(mode=0o700)
        quota = CpuQuota(ns, self.cpus[name]) if name in self.cpus else None
        return Host(name, ns, address, port, hosts_file, self.switch, home, quota=quota)

    def hosts_text(self, name: str) -> str:
        lines = ["127.0.0.1 localhost"]
        own = self.own_name.get(name, "address")
        if own == "loopback":
            lines.append(f"127.0.1.1 {name}")
        for other in self.names:
            if other != name or own == "address":
                lines.append(f"{self.address(other)} {other}")
        return "\n".join(lines) + "\n"

    def cpu_rates(self, seconds: float = 2.0) -> dict[str, dict[str, float]]:
        """Each capped host's quota and the share of a core a busy loop in it got (all hosts at once: together
        they must still each get their share)."""
        code = RATE_PROBE.format(seconds=seconds)
        procs = {name: subprocess.Popen(host._enter([sys.executable, "-c", code]), stdout=subprocess.PIPE,
                                        text=True, preexec_fn=host._join)
                 for name, host in self.hosts.items() if host.quota is not None}
        return {name: {"quota": self.hosts[name].quota.cores, "measured": round(float(p.communicate()[0]), 3)}
                for name, p in procs.items()}

    def down(self) -> None:
        """Every process in every namespace of ours ends, then the namespaces and cgroups go (idempotent)."""
        for host in self.hosts.values():
            host.kill()
        _end_namespaces([f"{self.tag}-{n}" for n in self.names] + [self.switch])
        for host in self.hosts.values():
            if host.quota is not None:
                host.quota.remove()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of ours is still there: namespaces, processes in them, the work folder."""
        left = [ns for ns in _namespaces() if ns.startswith(self.tag + "-")]
        left += [str(h.quota.path) for h in self.hosts.values() if h.quota is not None and h.quota.path.exists()]
        if self.workdir is not None and self.workdir.exists():
            left.append(str(self.workdir))
        return left


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _end_namespaces(names: Sequence[str]) -> None:
    present = set(_namespaces())
    for ns in names:
        if ns not in present:
            continue
        for _ in range(50):
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        _ip("netns", "del", ns, check=False)


def sweep_orphans(prefix: str = PREFIX) -> list[str]:
    """Namespaces (and work folders) of this module whose owner process is gone: a run killed before its
    teardown. Only names `<prefix>-<pid>-...` with a dead pid are touched."""
    owners: dict[int, list[str]] = {}
    for ns in _namespaces():
        parts = ns.split("-")
        if len(parts) >= 3 and parts[0] == prefix and parts[1].isdigit():
            owners.setdefault(int(parts[1]), []).append(ns)
    swept = []
    for pid, names in owners.items():
        if _alive(pid):
            continue
        _end_namespaces(names)
        swept += names
        for folder in Path("/var/tmp").glob(f"{prefix}-{pid}-*"):
            shutil.rmtree(folder, ignore_errors=True)
    for kind, parent in (("v1", CGROUP_V1), ("v2", CGROUP_V2)):
        for group in parent.glob(f"{prefix}-*-*") if kind == cgroup_kind() else ():
            owner = group.name.split("-")[1]
            if owner.isdigit() and not _alive(int(owner)):
                with contextlib.suppress(OSError):
                    group.rmdir()
                    swept.append(str(group))
    return swept


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def test_hosts(names: Sequence[str], own_name: dict[str, str] | None = None,
               cpus: dict[str, float] | None = None) -> Iterator[TestHosts]:
    hosts = TestHosts(names, cpus or {}, own_name or {})
    hosts.up()
    try:
        yield hosts
    finally:
        hosts.down()
