"""The one authority on the parallel layout pp x dp x tp (x ep inside dp): every rule, the ranks, the meshes.

The config (`check_config`: the rules that need no world size), the planner, the CLI's checks of each world
size a run may take (`check_world_sizes`) and the workers (`ParallelLayout.of`) all ask this module, so a bad
layout gets the same one line everywhere. The pipeline's split of the blocks into stages (`split_stages`,
balanced by `block_costs`) is here too: the engine cuts the model with it, the planner counts with it.

Ranks are laid out pp-major, then dp, with tp innermost, as torchtitan's ParallelDims:
rank = (pp_rank * dp + dp_rank) * tp + tp_rank, so a tp group (the most frequent all-reduces) stays inside a
node. ep borrows from dp as its inner part: dp_rank = edp_rank * ep + ep_rank; `edp` ranks hold the same
experts (their gradients are summed there). The meshes are built on first use, in a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from trainers._base import ConfigError
from trainers.config import MULTI_STAGE_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, RunConfig, num_stages
from trainers.config import check_layout as check_config

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from trainers.sections.model import ModelConfig

__all__ = ["MULTI_STAGE_SCHEDULES", "SPLIT_BACKWARD_SCHEDULES", "ParallelLayout", "block_costs",
           "check_config", "check_world_sizes", "num_stages", "split_stages"]

# ------------------------------------------------------------------------------------------ the split


def block_costs(cfg: ModelConfig, seq_len: int) -> list[float]:
    """Forward FLOPs per token of each block (`trainers.models.flops.block_forward_flops`)."""
    from trainers.models.flops import block_forward_flops

    return [block_forward_flops(cfg, i, seq_len) for i in range(cfg.n_layers)]


def split_stages(costs: list[float], num_stages: int) -> list[list[int]]:
    """Contiguous blocks per stage, each stage at least one, minimising the costliest stage (exact, by
    dynamic programming over prefixes). Equal costs give equal block counts; where they cannot be equal,
    earlier stages get the extra blocks (the last stage also runs the head and the loss)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ConfigError(f"{num_stages} pipeline stages for {n} blocks; fix: use at most {n} stages")
    prefix = [0.0, *accumulate(costs)]
    # best[k][j]: the smallest max-stage cost of the first j blocks in k stages; cut[k][j]: its last cut
    best = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):  # the k-th stage holds blocks i..j-1
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost <= best[k][j] * (1 + 1e-12):  # <=: the latest cut wins ties (smaller last stages)
                    best[k][j], cut[k][j] = cost, i
    stages, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        stages.append(list(range(i, j)))
        j = i
    return stages[::-1]


# ---------------------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class ParallelLayout:
    """pp x dp x tp ranks (ep inside dp) of one run at one world size, and this rank's place in it.

    `of(cfg, world_size)` runs every rule; `build` only the degrees' arithmetic (for tests and tools)."""

    world_size: int
    rank: int
    dp: int
    device_type: str = "cpu"
    pp: int = 1
    ep: int = 1
    tp: int = 1
    virtual_stages: int = 1
    pipeline_schedule: str = "1f1b"
    accumulation: int = 1  # micro-batches per rank per step (micro x accumulation x dp = global batch)
    microbatches: int = 1  # pipeline microbatches per step (= accumulation without a pipeline)
    microbatch_size: int = 0  # samples per forward/backward (a pipeline splits a rank's share of the step)
    _mesh: list = field(default_factory=list, repr=False, compare=False)  # the meshes, once built

    @classmethod
    def of(cls, cfg: RunConfig, world_size: int, rank: int = 0, device_type: str = "cpu") -> ParallelLayout:
        """The layout of `cfg` at `world_size`, after every rule (ConfigError otherwise)."""
        par = cfg.parallel
        if par.engine == "none" and world_size > 1:
            raise ConfigError(
                f"parallel.engine=none at world size {world_size}; fix: set parallel.engine to ddp, fsdp or "
                f"deepspeed, or run one process"
            )
        lay = cls.build(world_size, rank, None, device_type, pp=par.pp, ep=par.ep, tp=par.tp)
        accumulation = cfg.train.accumulation(lay.dp)
        microbatches, size = accumulation, cfg.train.micro_batch_size
        if par.pp > 1:  # a pipeline runs its rank's share of the step in n_microbatches pieces
            share = cfg.train.global_batch_size // lay.dp
            microbatches = par.n_microbatches or accumulation
            if share % microbatches:
                raise ConfigError(
                    f"parallel.n_microbatches={microbatches} does not divide the {share} samples each "
                    f"pipeline runs per step (train.global_batch_size / data-parallel size {lay.dp}) at world "
                    f"size {world_size}; fix: use a divisor of {share}"
                )
            size = share // microbatches
        virtual = 2 if par.pipeline_schedule == "zbv" and par.pp > 1 else par.virtual_stages
        return replace(lay, virtual_stages=virtual, pipeline_schedule=par.pipeline_schedule,
                       accumulation=accumulation, microbatches=microbatches, microbatch_size=size)

    @classmethod
    def from_process_group(cls, cfg: RunConfig) -> ParallelLayout:
        """The layout of `cfg` over the running process group (a single process when none is initialised)."""
        import torch
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialised else 1
        rank = dist.get_rank() if initialised else 0
        return cls.of(cfg, world, rank, "cuda" if torch.cuda.is_available() else "cpu")

    @classmethod
    def build(cls, world_size: int, rank: int, dp: int | None = None, device_type: str = "cpu", pp: int = 1,
              ep: int = 1, tp: int = 1) -> ParallelLayout:
        """The degrees' arithmetic alone: pp and tp divide the world, ep divides dp."""
        if pp < 1 or world_size % pp:
            raise ConfigError(
                f"parallel.pp={pp} does not divide the world size {world_size}; fix: use a world size that "
                f"is a multiple of {pp} or change parallel.pp"
            )
        if tp < 1 or (world_size // pp) % tp:
            raise ConfigError(
                f"parallel.tp={tp} does not divide the world size {world_size} / pp={pp}; fix: use a world "
                f"size that is a multiple of {pp * tp} or change parallel.tp"
            )
        dp = world_size // (pp * tp) if dp is None else dp
        if dp * pp * tp != world_size:
            raise ConfigError(
                f"parallel layout: dp={dp} x pp={pp} x tp={tp} != world size {world_size}; fix: run "
                f"{dp * pp * tp} processes"
            )
        if ep < 1 or dp % ep:
            raise ConfigError(
                f"parallel.ep={ep} does not divide the data-parallel size {dp} (world size {world_size} / "
                f"pp={pp} / tp={tp}); fix: use an ep dividing {dp}, or a world size that is a multiple of "
                f"{ep * pp * tp}"
            )
        return cls(world_size=world_size, rank=rank, dp=dp, device_type=device_type, pp=pp, ep=ep, tp=tp)

    # ---------------------------------------------------------------------------------------- ranks

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp(self) -> int:
        """Replicas of each expert shard: data-parallel ranks holding the same experts."""
        return self.dp // self.ep

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def v_shape(self) -> bool:
        return self.pipeline_schedule == "zbv"

    def stage_owner(self, stage: int, v_shape: bool | None = None) -> int:
        """The pp rank holding pipeline `stage`: looped (stage s on rank s mod pp) as Interleaved1F1B
        expects, or V-shaped (rank r holds r and 2pp - 1 - r) as ZBVZeroBubble expects."""
        v_shape = self.v_shape if v_shape is None else v_shape
        if v_shape and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stage_ids(
        self, virtual_stages: int | None = None, v_shape: bool | None = None, pp_rank: int | None = None
    ) -> list[int]:
        """The pipeline stages of pp rank `pp_rank` (this rank's by default), in order."""
        virtual = self.virtual_stages if virtual_stages is None else virtual_stages
        owner = self.pp_rank if pp_rank is None else pp_rank
        return [s for s in range(self.pp * virtual) if self.stage_owner(s, v_shape) == owner]

    # ----------------------------------------------------------------------------------------- mesh

    def mesh(self) -> DeviceMesh:
        """The device mesh, built on first use in a process group: the dimensions among ("pp", "edp", "ep",
        "tp") with a degree > 1, and "dp" (the flattened ("edp", "ep") when ep > 1)."""
        if not self._mesh:
            from torch.distributed.device_mesh import init_device_mesh

            from trainers.torch_compat import flatten_mesh

            dims: list[tuple[str, int]] = [("pp", self.pp)] if self.pp > 1 else []
            dims += [("edp", self.edp), ("ep", self.ep)] if self.ep > 1 else [("dp", self.dp)]
            dims += [("tp", self.tp)] if self.tp > 1 else []
            names, sizes = zip(*dims)
            mesh = init_device_mesh(self.device_type, tuple(sizes), mesh_dim_names=tuple(names))
            # Keep the flattened dp mesh itself: slicing a flattened dim from the root is deprecated.
            self._mesh.extend([mesh, flatten_mesh(mesh["edp", "ep"], "dp") if self.ep > 1 else mesh["dp"]])
        return self._mesh[0]

    def dp_mesh(self) -> DeviceMesh:
        """The 1-D data-parallel mesh of this rank's pipeline stage and tp rank (what FSDP shards over)."""
        self.mesh()
        return self._mesh[1]

    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's tensor-parallel group (None without tensor parallelism)."""
        return self.mesh()["tp"] if self.tp > 1 else None

    def expert_mesh(self) -> DeviceMesh | None:
        """Where expert weights are split: ("ep",), ("tp",) or ("ep", "tp"); None when neither is > 1."""
        names = tuple(n for n, d in (("ep", self.ep), ("tp", self.tp)) if d > 1)
        return self.mesh()[names] if names else None

    def pp_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline (None without pipeline parallelism)."""
        return self.mesh().get_group("pp") if self.pp > 1 else None

    def edp_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the same experts as this one (None when there is only this one)."""
        return self.mesh().get_group("edp") if self.ep > 1 and self.edp > 1 else None

    def tp_group(self) -> dist.ProcessGroup | None:
        return self.mesh().get_group("tp") if self.tp > 1 else None


# ------------------------------------------------------------------------------- every world size


def check_world_sizes(cfg: RunConfig, sizes: Any, where: str = "scaling allows") -> list[ParallelLayout]:
    """`ParallelLayout.of` at every world size in `sizes` (a run may take any of them: elastic runs,
    clusters where other jobs hold some GPUs). The first bad one raises, naming the size and the range."""
    sizes = list(sizes)
    layouts = []
    for world in sizes:
        try:
            layouts.append(ParallelLayout.of(cfg, world))
        except ConfigError as e:
            if len(sizes) == 1:
                raise
            span = f"{sizes[0]}..{sizes[-1]}" if sizes == list(range(sizes[0], sizes[-1] + 1)) else str(sizes)
            raise ConfigError(f"at world size {world} ({where} {span}): {e}") from None
    return layouts
