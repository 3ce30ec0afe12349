"""Small probes run inside a test host (`python -c "from tests.cluster.probe import ..."`)."""

from __future__ import annotations

import socket
import time


def wait_tcp(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_nodes(address: str, count: int, timeout: float) -> None:
    """Until `count` Ray nodes are alive."""
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        deadline = time.monotonic() + timeout
        while sum(n["Alive"] for n in ray.nodes()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sum(n['Alive'] for n in ray.nodes())} of {count} Ray nodes alive")
            time.sleep(0.5)
    finally:
        ray.shutdown()


def wait_key(uri: str, timeout: float) -> None:
    """Until the object (or folder) `uri` exists."""
    from trainers.storage import location

    path = location(uri)
    deadline = time.monotonic() + timeout
    while True:
        path.fs.invalidate_cache()  # s3fs caches listings: ask the store each time
        if path.exists():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{uri} did not appear within {timeout:.0f}s")
        time.sleep(0.3)


def node_started(address: str, ip: str) -> None:
    """Print when the live Ray node at `ip` started (its `start_time_ms` in Ray's node table, as seconds)."""
    import ray
    from ray.util.state import list_nodes

    ray.init(address=address, log_to_driver=False)
    try:
        started = [n.start_time_ms for n in list_nodes(detail=True) if n.node_ip == ip and n.state == "ALIVE"]
        print(max(started) / 1000)
    finally:
        ray.shutdown()
