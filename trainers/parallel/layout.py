"""One object owns the parallel layout: it validates the degrees against the world size and builds the
DeviceMesh. Nothing else computes ranks or groups.

Today the mesh has one dimension, `dp` (data parallel, sharded or not). Pipeline (`pp`) and expert
(`ep`) degrees slot in as further mesh dimensions: world = pp x dp, and ep divides dp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainers._base import ConfigError

__all__ = ["ParallelLayout"]


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    rank: int
    dp: int
    device_type: str = "cpu"

    @classmethod
    def from_process_group(cls, dp: int | None = None) -> ParallelLayout:
        """The layout of the running process group (a single process when none is initialised)."""
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        rank = dist.get_rank() if initialised else 0
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return cls.build(world, rank, dp, device_type)

    @classmethod
    def build(
        cls, world_size: int, rank: int, dp: int | None = None, device_type: str = "cpu"
    ) -> ParallelLayout:
        dp = world_size if dp is None else dp
        if dp < 1 or world_size % dp:
            raise ConfigError(
                f"parallel layout: data-parallel degree {dp} does not divide the world size {world_size}; "
                f"fix: use a world size that is a multiple of {dp}"
            )
        if dp != world_size:  # until pipeline parallelism: every rank is a data-parallel rank
            raise ConfigError(
                f"parallel layout: dp={dp} x pp=1 != world size {world_size}; fix: run {dp} processes"
            )
        return cls(world_size=world_size, rank=rank, dp=dp, device_type=device_type)

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    def mesh(self) -> DeviceMesh:
        """The device mesh (built on first use; needs an initialised process group)."""
        return init_device_mesh(self.device_type, (self.dp,), mesh_dim_names=("dp",))
