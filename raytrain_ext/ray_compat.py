"""Private names of Ray that raytrain-ext relies on, in one place, with the version they were read from.

Each entry says what it is for and what to look at when Ray moves. Written against Ray 2.60.0.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

RAY_VERSION = "2.60.0"

__all__ = ["HEAD_NODE_RESOURCE", "RAY_VERSION", "refresh_autoscaling_view", "torch_backend_with"]

# ray/_common/constants.py HEAD_NODE_RESOURCE_NAME: a resource of 1 that Ray gives the head node only (a
# request for a share of it places an actor there).
HEAD_NODE_RESOURCE = "node:__internal_head__"


@cache
def torch_backend_with(before_start: Callable[[Any], None]) -> type:
    """Ray Train's torch backend class, running `before_start(worker_group)` before its process group."""
    # ray/train/torch/config.py: `_TorchBackend.on_start(worker_group, backend_config)` makes the process
    # group (MASTER_ADDR from rank 0's node address, then `init_process_group` in every worker). A subclass
    # runs `before_start(worker_group)` first; TorchConfig.backend_cls is the public hook that names it.
    from ray.train.torch.config import _TorchBackend

    class Backend(_TorchBackend):
        def on_start(self, worker_group: Any, backend_config: Any) -> None:
            before_start(worker_group)
            super().on_start(worker_group, backend_config)

    return Backend


# ray/data/_internal/cluster_autoscaler/default_autoscaling_coordinator.py: Ray Train's elastic scaling policy
# sizes a worker group from the resources this detached actor reserves for it, and the actor re-reads the
# node table only every `TICK_INTERVAL_S` (20 s). After a host is lost or joins, a
# `get_reserved_resources(..., recompute=True)` makes it tick at once.
_COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")  # (name, namespace)


def refresh_autoscaling_view() -> bool:
    """Make Ray's autoscaling coordinator re-read the cluster's nodes now; False when there is none (no
    elastic run has started) or it did not answer."""
    import ray

    name, namespace = _COORDINATOR
    try:
        actor = ray.get_actor(name, namespace=namespace)
        ray.get(actor.get_reserved_resources.remote("raytrain-hosts", recompute=True), timeout=10)
    except Exception:  # noqa: BLE001 - none yet, or busy: its own 20 s tick still comes
        return False
    return True
