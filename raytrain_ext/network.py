"""Which network a run's collectives use: the interface of the address Ray placed each worker at.

gloo picks its interface from the host's name: a hostname that resolves to loopback (Debian's default
`/etc/hosts` line `127.0.1.1 HOST`) or to nothing makes every rank offer a loopback address to its peers,
and a run across machines fails after ~50 s with "Gloo connectFullMesh failed ... remote=[127.0.1.1]".
Ray already knows the address each node is reached at (`ray start --node-ip-address`, or the one it found):
each worker gives gloo the interface that holds that address (`GLOO_SOCKET_IFNAME`) before its process
group is made, so a run works whatever the hosts' names resolve to. gloo also carries a GPU run's
checkpoint collectives (DCP's "cpu:gloo" group), so it is set for NCCL runs too. A `GLOO_SOCKET_IFNAME`
the user set on the nodes wins.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig

from raytrain_ext import ray_compat

__all__ = ["NodeAddressTorchConfig", "interface_of", "pin_gloo_interface", "replica_groups_config"]

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds `address`, or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address
               for a in addresses):
            return name
    return None


def pin_gloo_interface() -> None:
    """In a Train worker, before its process group: gloo on the interface of the worker's Ray address."""
    import ray

    if GLOO_IFNAME in os.environ:
        return
    interface = interface_of(ray.util.get_node_ip_address())
    if interface:
        os.environ[GLOO_IFNAME] = interface


@dataclass
class NodeAddressTorchConfig(TorchConfig):
    """Ray Train's TorchConfig whose backend first pins gloo to each worker's Ray address."""

    @property
    def backend_cls(self):
        return ray_compat.torch_backend_with(_pin_every_worker)


def _pin_every_worker(worker_group: Any) -> None:
    worker_group.execute(pin_gloo_interface)


def name_replica_group(workers_per_group: int) -> None:
    """In a Train worker of a per-step fault-tolerant run, before its Trainer: its replica group (Ray ranks the
    workers group by group) and the address torchft's manager gives its peers (the node's Ray address, as
    gloo's above)."""
    import ray
    import ray.train

    from trainers.fault_tolerance import GROUP_ENV, HOST_ENV

    os.environ[GROUP_ENV] = str(ray.train.get_context().get_world_rank() // workers_per_group)
    os.environ[HOST_ENV] = ray.util.get_node_ip_address()


def replica_groups_config(backend: str, workers_per_group: int) -> Any:
    """Ray Train's torchft config for `scaling.fault_tolerance: per_step` (`trainers.fault_tolerance`)."""
    from trainers.fault_tolerance import LIGHTHOUSE

    return ray_compat.torchft_config(_pin_every_worker, LIGHTHOUSE, backend, group_size=workers_per_group)
