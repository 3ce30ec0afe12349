"""The one authority on the parallel layout pp x dp x tp (x ep inside dp): every rule, the ranks, the meshes.

Every part that needs to know whether a layout is valid asks this module: the config (`check_config`, the
rules that need no world size), the planner, `raytrain train`'s and `raytrain cluster check`'s checks of
each world size a run may take (`check_world_sizes`), and the workers themselves (`ParallelLayout.of`). So
a bad layout gets the same one line from `raytrain plan`, `raytrain train`, `raytrain cluster check` and
`torchrun -m trainers train`.

Ranks are laid out pp-major, then dp, with tp innermost, as torchtitan's ParallelDims:
rank = (pp_rank * dp + dp_rank) * tp + tp_rank. A tp group is tp consecutive ranks, so on GPUs it stays
inside a node (its all-reduces are the most frequent). Inside the data-parallel dimension ep is the inner
part (ep borrows from dp, as in torchtitan): dp_rank = edp_rank * ep + ep_rank, so each dp group splits
into dp/ep expert groups of ep consecutive dp ranks, which together hold all experts of a layer (`edp`
ranks hold the same experts: expert gradients are summed there).

Importing this module does not import torch (the CLI checks layouts before any worker starts); the
meshes are built on first use, in a process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainers._base import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from trainers.config import RunConfig

__all__ = ["ParallelLayout", "check_config", "check_world_sizes"]

MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zbv")
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv")  # zero-bubble: input and weight gradients apart


# ------------------------------------------------------------------------------ rules without a world


def check_config(cfg: RunConfig) -> None:
    """The layout rules that need no world size: degrees against the model, the engine, the schedule and
    the precision. Raises ConfigError (one line with its fix). RunConfig runs it on every load."""
    par, model = cfg.parallel, cfg.model
    for knob, degree in (("pp", par.pp), ("tp", par.tp), ("ep", par.ep)):
        if degree > 1 and par.engine != "fsdp":
            raise ConfigError(
                f"parallel.{knob}={degree} needs parallel.engine=fsdp (got {par.engine}); fix: set "
                f"parallel.engine=fsdp"
            )
    multi = par.pipeline_schedule in MULTI_STAGE_SCHEDULES
    if par.pp == 1 and (par.virtual_stages > 1 or par.n_microbatches is not None):
        raise ConfigError(
            f"parallel.virtual_stages={par.virtual_stages}, n_microbatches={par.n_microbatches} with pp=1 "
            f"(no pipeline); fix: set parallel.pp > 1 or remove them"
        )
    if par.virtual_stages > 1 and not multi:
        raise ConfigError(
            f"parallel.virtual_stages={par.virtual_stages} needs an interleaved schedule (pipeline_schedule="
            f"{par.pipeline_schedule} runs one stage per rank); fix: set parallel.pipeline_schedule="
            f"interleaved_1f1b"
        )
    if par.pp > 1 and multi and par.virtual_stages < 2:
        raise ConfigError(
            f"parallel.pipeline_schedule={par.pipeline_schedule} needs virtual_stages >= 2; fix: set "
            f"parallel.virtual_stages=2"
        )
    if par.pipeline_schedule == "zbv" and par.virtual_stages not in (1, 2):
        raise ConfigError(
            "parallel.pipeline_schedule=zbv runs exactly 2 stages per rank; fix: set parallel.virtual_stages=2"
        )
    stages = num_stages(par.pp, par.virtual_stages, par.pipeline_schedule)
    if stages > model.n_layers:
        raise ConfigError(
            f"parallel.pp={par.pp} x virtual_stages={par.virtual_stages} = {stages} pipeline stages for "
            f"model.n_layers={model.n_layers} (stages get whole blocks); fix: lower pp/virtual_stages"
        )
    if par.pp > 1 and model.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings=true with parallel.pp > 1 (the embedding and head live on different "
            "stages); fix: set model.tie_embeddings=false"
        )
    if par.pp > 1 and cfg.precision.dtype == "fp16":
        raise ConfigError(
            "precision.dtype=fp16 with parallel.pp > 1 (no loss scaling inside pipeline schedules); "
            "fix: use precision.dtype=bf16 or fp32"
        )
    if par.pp > 1 and par.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES and par.zero_stage == 3:
        raise ConfigError(
            f"parallel.zero_stage=3 with pipeline_schedule={par.pipeline_schedule}: zero-bubble schedules "
            f"compute weight gradients after resharding would have freed the gathered weights; fix: set "
            f"parallel.zero_stage=2 (or leave it unset)"
        )
    if par.ep > 1 and model.moe is None:
        raise ConfigError(f"parallel.ep={par.ep} needs an MoE model; fix: set model.moe or parallel.ep=1")
    if par.ep > 1 and model.moe.num_experts % par.ep:
        raise ConfigError(
            f"parallel.ep={par.ep} does not divide model.moe.num_experts={model.moe.num_experts}; "
            f"fix: use an ep that divides it"
        )
    if par.tp > 1:
        _check_tp(cfg)


def _check_tp(cfg: RunConfig) -> None:
    """Tensor parallelism splits heads and the FFN's hidden units into tp equal parts (the vocabulary into
    parts as equal as torch.chunk makes them: a vocabulary of 257 is split 129 + 128)."""
    tp, model = cfg.parallel.tp, cfg.model
    sizes = [("model.n_heads", model.n_heads), ("the KV heads (model.n_kv_heads)", model.kv_heads)]
    sizes += [("the FFN hidden size", model.hidden_dim)]
    for what, size in sizes:
        if size % tp:
            divisors = [d for d in range(2, size + 1) if size % d == 0][:6]
            raise ConfigError(
                f"parallel.tp={tp} does not divide {what} = {size} (tensor parallelism splits it into tp "
                f"equal parts); fix: use tp in {divisors or [1]} or change the model"
            )
    if cfg.data.seq_len % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide data.seq_len={cfg.data.seq_len} (sequence parallelism splits "
            f"each sequence over the tp ranks); fix: use a seq_len that is a multiple of {tp}"
        )
    if model.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings=true with parallel.tp > 1 (the embedding is split by rows, the head by "
            "columns); fix: set model.tie_embeddings=false"
        )
    if model.init_from is not None:
        raise ConfigError(
            "model.init_from with parallel.tp > 1 (loading Hugging Face tensors into tensor-parallel shards is "
            "not built yet); fix: start the run at tp=1 (save a checkpoint, e.g. train.steps=0) and resume it "
            "with parallel.tp set: checkpoints reshard across tp"
        )
    if cfg.precision.dtype == "fp16":
        raise ConfigError(
            "precision.dtype=fp16 with parallel.tp > 1 (the loss scaler does not see tensor-parallel "
            "gradients); fix: use precision.dtype=bf16 or fp32"
        )


def num_stages(pp: int, virtual_stages: int, schedule: str) -> int:
    """Pipeline stages in all: pp x stages per rank (zbv always runs two per rank)."""
    return pp * (2 if schedule == "zbv" and pp > 1 else virtual_stages)


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
    schedule: str = "1f1b"
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
        return cls(
            world_size=world_size,
            rank=rank,
            dp=lay.dp,
            device_type=device_type,
            pp=par.pp,
            ep=par.ep,
            tp=par.tp,
            virtual_stages=2 if par.pipeline_schedule == "zbv" and par.pp > 1 else par.virtual_stages,
            schedule=par.pipeline_schedule,
            accumulation=accumulation,
            microbatches=microbatches,
            microbatch_size=size,
        )

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
    def build(
        cls,
        world_size: int,
        rank: int,
        dp: int | None = None,
        device_type: str = "cpu",
        pp: int = 1,
        ep: int = 1,
        tp: int = 1,
    ) -> ParallelLayout:
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

    def describe(self) -> str:
        parts = [f"pp={self.pp}"] * (self.pp > 1) + [f"dp={self.dp}"] + [f"tp={self.tp}"] * (self.tp > 1)
        return " x ".join(parts) + (f" (ep={self.ep} inside dp)" if self.ep > 1 else "")

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
        return self.schedule == "zbv"

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
        """The device mesh (built on first use; needs an initialised process group). Its dimensions are
        those with a degree > 1 among ("pp", "edp", "ep", "tp"), with "dp" always there: the mesh's own
        dimension when ep = 1, the flattened ("edp", "ep") otherwise."""
        if not self._mesh:
            from torch.distributed.device_mesh import init_device_mesh

            dims: list[tuple[str, int]] = [("pp", self.pp)] if self.pp > 1 else []
            dims += [("edp", self.edp), ("ep", self.ep)] if self.ep > 1 else [("dp", self.dp)]
            dims += [("tp", self.tp)] if self.tp > 1 else []
            names, sizes = zip(*dims)
            mesh = init_device_mesh(self.device_type, tuple(sizes), mesh_dim_names=tuple(names))
            # Keep the flattened dp mesh itself: slicing a flattened dim from the root is deprecated.
            self._mesh.extend([mesh, mesh["edp", "ep"]._flatten("dp") if self.ep > 1 else mesh["dp"]])
        return self._mesh[0]

    def dp_mesh(self) -> DeviceMesh:
        """The 1-D data-parallel mesh of this rank's pipeline stage and tp rank (what FSDP shards over)."""
        self.mesh()
        return self._mesh[1]

    def ep_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's expert group (ep consecutive data-parallel ranks)."""
        return self.mesh()["ep"]

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
