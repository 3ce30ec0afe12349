"""One object owns the parallel layout: it validates the degrees against the world size and builds the
DeviceMesh. Nothing else computes ranks or groups.

Ranks are laid out pp-major, as torchtitan's ParallelDims: rank = pp_rank * dp + dp_rank, and inside the
data-parallel dimension ep is the inner part: dp_rank = edp_rank * ep + ep_rank. So each pipeline stage
has its own dp group, and each dp group splits into dp/ep expert groups of ep consecutive ranks, which
together hold all experts of a layer (`edp` ranks hold the same experts: expert gradients are summed there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    pp: int = 1
    ep: int = 1
    _mesh: list = field(default_factory=list, repr=False, compare=False)  # the mesh, once built

    @classmethod
    def from_process_group(cls, dp: int | None = None, pp: int = 1, ep: int = 1) -> ParallelLayout:
        """The layout of the running process group (a single process when none is initialised)."""
        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        rank = dist.get_rank() if initialised else 0
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return cls.build(world, rank, dp, device_type, pp=pp, ep=ep)

    @classmethod
    def build(
        cls,
        world_size: int,
        rank: int,
        dp: int | None = None,
        device_type: str = "cpu",
        pp: int = 1,
        ep: int = 1,
    ) -> ParallelLayout:
        if pp < 1 or world_size % pp:
            raise ConfigError(
                f"parallel.pp={pp} does not divide the world size {world_size}; fix: run a multiple of {pp} "
                f"processes or change parallel.pp"
            )
        dp = world_size // pp if dp is None else dp
        if dp < 1 or world_size % dp:
            raise ConfigError(
                f"parallel layout: data-parallel degree {dp} does not divide the world size {world_size}; "
                f"fix: use a world size that is a multiple of {dp}"
            )
        if dp * pp != world_size:
            raise ConfigError(
                f"parallel layout: dp={dp} x pp={pp} != world size {world_size}; fix: run {dp * pp} processes"
            )
        if ep < 1 or dp % ep:
            raise ConfigError(
                f"parallel.ep={ep} does not divide the data-parallel size {dp} (world {world_size} / pp {pp}); "
                f"fix: use an ep dividing {dp}, or run a multiple of {ep * pp} processes"
            )
        return cls(world_size=world_size, rank=rank, dp=dp, device_type=device_type, pp=pp, ep=ep)

    # ---------------------------------------------------------------------------------------- ranks

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.dp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp(self) -> int:
        """Replicas of each expert shard: data-parallel ranks holding the same experts."""
        return self.dp // self.ep

    def stage_owner(self, stage: int, v_shape: bool = False) -> int:
        """The pp rank holding pipeline `stage`: looped (stage s on rank s mod pp) as Interleaved1F1B
        expects, or V-shaped (rank r holds r and 2pp - 1 - r) as ZBVZeroBubble expects."""
        if v_shape and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stage_ids(self, virtual_stages: int, v_shape: bool = False) -> list[int]:
        """This rank's pipeline stages, in order, of pp x virtual_stages in all."""
        stages = range(self.pp * virtual_stages)
        return [s for s in stages if self.stage_owner(s, v_shape) == self.pp_rank]

    # ----------------------------------------------------------------------------------------- mesh

    def mesh(self) -> DeviceMesh:
        """The device mesh (built on first use; needs an initialised process group): ("dp",) alone, or
        ("pp", "edp", "ep") with "dp" = ("edp", "ep") flattened when pipeline or expert degrees are set."""
        if not self._mesh:
            if self.pp == 1 and self.ep == 1:
                mesh = init_device_mesh(self.device_type, (self.dp,), mesh_dim_names=("dp",))
            else:
                mesh = init_device_mesh(
                    self.device_type, (self.pp, self.edp, self.ep), mesh_dim_names=("pp", "edp", "ep")
                )
                # Keep the flattened dp mesh itself: slicing a flattened dim from the root is deprecated.
                self._mesh.append(mesh["edp", "ep"]._flatten("dp"))
            self._mesh.insert(0, mesh)
        return self._mesh[0]

    def dp_mesh(self) -> DeviceMesh:
        """The 1-D data-parallel mesh of this rank's pipeline stage (what FSDP shards over)."""
        mesh = self.mesh()
        return mesh if mesh.ndim == 1 else self._mesh[1]

    def ep_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's expert group (ep consecutive data-parallel ranks)."""
        return self.mesh()["ep"]

    def pp_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline (None without pipeline parallelism)."""
        return self.mesh().get_group("pp") if self.pp > 1 else None

    def edp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts as this one (None when there is only this one)."""
        return self.mesh().get_group("edp") if self.pp * self.ep > 1 and self.edp > 1 else None
