"""Hosts that leave and rejoin the cluster, told on the console in one line each, with the cause.

A lost host raises nothing a driver can catch: its workers' collectives fail on the survivors ("Connection
reset by peer", or a timeout behind a partition), Ray's GCS marks the node dead once its health checks fail,
and Ray Train restarts the group at the size the cluster now holds. `HostWatcher` polls the GCS's node table
(`ray.nodes()`) in the driver; when a node of the cluster goes from alive to dead it asks the host's address
why, on the raylet's own port:
- the connection is refused: the host is up but its Ray is gone (killed, crashed, OOM, stopped);
- no answer (a timeout, host or network unreachable): the host is cut off or down; its processes may live on
  behind a partition, which is why it is never reported as "killed".
The GCS's own record (`DeathReason`: an expected termination, a drain for preemption or idleness) names the
cause when it has one. A node that joins with the address of a lost host is told as that host's return.
Either way Ray's autoscaling coordinator, whose view of the nodes Ray Train's elastic sizing reads, is made
to look again at once instead of at its next 20 s tick: the run shrinks or grows on what is there now.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ext import ray_compat

__all__ = ["HostWatcher", "LostHost", "on_this_node", "probe_cause"]

# The GCS's NodeDeathInfo.Reason (src/ray/protobuf/gcs.proto), as ray.nodes() gives it.
_EXPECTED, _PREEMPTED, _IDLE = 1, 3, 4

UNREACHABLE = "unreachable: no answer from its address (a network partition, or the machine is down)"
RAY_GONE = "its Ray processes are gone: the machine answers but nothing listens (killed, crashed or out of memory)"


def on_this_node() -> Any:
    """A scheduling strategy that places an actor on the caller's node, never elsewhere. Ray spreads actors
    that ask for no CPU over the cluster's nodes; one that a driver (or a trial) relies on, such as an
    experiment's decision board, would then die with whatever worker host it landed on, taking every trial
    with it. On the caller's node it lives exactly as long as its caller."""
    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)


@dataclass
class LostHost:
    node_id: str
    hostname: str
    address: str
    cause: str
    since: float = field(default_factory=time.time)


def probe_cause(address: str, port: int, timeout_s: float = 3.0) -> str:
    """Why the raylet at address:port is gone, from one TCP connect (see the module's docstring)."""
    try:
        socket.create_connection((address, port), timeout=timeout_s).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return RAY_GONE
    except OSError:  # a timeout, EHOSTUNREACH, ENETUNREACH: nothing answered
        return UNREACHABLE
    return "its raylet answers again but the GCS declared it dead (a raylet that stalled past its health checks)"


def _gcs_cause(node: dict[str, Any]) -> str | None:
    reason, message = node.get("DeathReason"), (node.get("DeathReasonMessage") or "").strip()
    if reason == _EXPECTED:
        return f"its Ray was stopped ({message or 'an expected termination'})"
    if reason == _PREEMPTED:
        return f"drained for preemption ({message or 'the autoscaler'})"
    if reason == _IDLE:
        return f"removed as idle by the autoscaler ({message})" if message else "removed as idle by the autoscaler"
    return None


class HostWatcher:
    """Polls Ray's node table in a thread; `say(line)` for each host lost or back. `lost` holds the hosts
    now out of the cluster, by address (WorkerLogs asks it, so a worker lost with its host is told once)."""

    def __init__(self, say: Callable[[str], None], what_next: Callable[[LostHost], str], back_next: str,
                 interval_s: float = 1.0, nodes: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.say, self.what_next, self.back_next, self.interval_s = say, what_next, back_next, interval_s
        self._nodes = nodes
        self.on_change: Callable[[], Any] = ray_compat.refresh_autoscaling_view
        self.lost: dict[str, LostHost] = {}
        self.alive: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-hosts", daemon=True)

    def start(self) -> HostWatcher:
        self.alive = self._alive(self._table())
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _table(self) -> list[dict[str, Any]]:
        if self._nodes is not None:
            return self._nodes()
        import ray

        return ray.nodes()

    @staticmethod
    def _alive(table: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return {n["NodeID"]: n for n in table if n.get("Alive")}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the GCS briefly unreachable: ask again next time
                continue

    def poll(self) -> bool:
        table = self._table()
        by_id = {n["NodeID"]: n for n in table}
        alive = self._alive(table)
        for node_id, node in self.alive.items():
            if node_id in alive:
                continue
            dead = by_id.get(node_id, node)
            address = node["NodeManagerAddress"]
            cause = _gcs_cause(dead) or probe_cause(address, int(node["NodeManagerPort"]))
            host = LostHost(node_id, node.get("NodeManagerHostname") or address, address, cause)
            self.lost[address] = host
            self.say(f"raytrain: lost host {host.hostname} ({address}): {cause}; {self.what_next(host)}")
        for node_id, node in alive.items():
            if node_id in self.alive:
                continue
            back = self.lost.pop(node["NodeManagerAddress"], None)
            if back is not None:
                away = time.time() - back.since
                self.say(f"raytrain: host {back.hostname} ({back.address}) is back in the cluster after {away:.0f} s; "
                         f"{self.back_next}")
        if changed := (set(alive) != set(self.alive)):
            self.on_change()
        self.alive = alive
        return changed

    def is_lost(self, address: str | None) -> bool:
        return address is not None and address in self.lost
