"""A run is one YAML file validated into these typed models: each component owns its section, cross-section
checks live in `RunConfig._check`, and every failure is a `ConfigError`: one line naming the key and the fix.
Checks that read the disk or a model folder are `trainers.preflight`'s; the layout's rules at a world size,
`trainers.layout`'s. The bottom of the run-config layer (tests/test_architecture.py holds the order).
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from trainers._base import ConfigError, StrictModel, checked_size
from trainers.profiling import ProfileConfig
from trainers.sections.data import DataConfig
from trainers.sections.model import ModelConfig, MoEConfig
from trainers.sections.tracking import TrackingConfig
from trainers.storage import Location

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "HPARAM_PREFIXES",
    "MULTI_STAGE_SCHEDULES",
    "MemoryConfig",
    "ModelConfig",
    "MoEConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ProfileConfig",
    "RunConfig",
    "SPLIT_BACKWARD_SCHEDULES",
    "LRScheduleConfig",
    "ScalingConfig",
    "TrainConfig",
    "TrackingConfig",
    "apply_overrides",
    "check_hparam_keys",
    "check_layout",
    "load_config",
    "num_stages",
    "parse_config",
    "with_values",
]


class OptimizerConfig(StrictModel):
    name: Literal["sgd", "adagrad", "rmsprop", "adam", "adamw"] = Field("adamw", description="optimizer kind")
    lr: PositiveFloat = Field(3e-4, description="peak learning rate (the schedule scales it)")
    weight_decay: float = Field(0.0, ge=0)  # never applied to norms, biases or embeddings
    betas: tuple[float, float] = (0.9, 0.95)  # adam, adamw
    eps: PositiveFloat = Field(1e-8, description="adam, adamw, rmsprop, adagrad: added to the denominator")
    momentum: float = Field(0.0, ge=0)  # sgd, rmsprop
    nesterov: bool = False  # sgd (needs momentum > 0)
    alpha: float = Field(0.99, gt=0, lt=1)  # rmsprop smoothing
    grad_clip: PositiveFloat | None = 1.0  # max global grad norm; None = no clipping
    # torch's fused step (one kernel per parameter, no temporaries; CPU and CUDA) for sgd/adagrad/adam/adamw;
    # off: torch's default (for-each on CUDA, per-tensor on CPU)
    fused: bool = False

    @model_validator(mode="after")
    def _check(self) -> OptimizerConfig:
        if self.nesterov and (self.name != "sgd" or self.momentum <= 0):
            raise ValueError("nesterov needs name=sgd and momentum > 0; fix: set momentum or nesterov=false")
        if self.fused and self.name == "rmsprop":
            raise ValueError("fused=true: torch has no fused rmsprop; fix: set fused=false or another optimizer")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas={self.betas} must lie in [0, 1); fix: e.g. [0.9, 0.95]")
        return self


# The learning-rate schedule: the run YAML's `schedule:` section (parallel.pipeline_schedule is the pipeline's).
class LRScheduleConfig(StrictModel):
    name: Literal["constant", "warmup_cosine", "warmup_linear", "inverse_sqrt", "exponential", "step"] = Field(
        "warmup_cosine", description="learning-rate schedule over train.steps"
    )
    warmup_steps: NonNegativeInt = 0  # linear warmup from 0 (all schedules but constant/exponential/step)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)  # floor of cosine/linear decay, as a fraction of lr
    decay_steps: PositiveInt | None = None  # cosine/linear: None = train.steps - warmup_steps
    gamma: float = Field(0.5, gt=0, le=1)  # exponential (per step_size steps) and step
    step_size: PositiveInt = 100  # exponential and step


class PrecisionConfig(StrictModel):
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # bf16/fp16: autocast, fp32 master weights
    init_scale: PositiveFloat = 2.0**16  # fp16 dynamic loss scaling
    growth_interval: PositiveInt = Field(
        2000, description="fp16: steps without an overflow before the loss scale doubles"
    )
    # CUDA only: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs, fp32 sums), as
    # torch.set_float32_matmul_precision("high"); false keeps true fp32 ("highest"). No effect on a CPU.
    tf32: bool = True


class MemoryConfig(StrictModel):
    # off | every (each block) | k (every k-th block) - recompute block activations in backward;
    # selective: every block keeps its matmul and attention outputs and recomputes only the cheap ops
    activation_checkpointing: Literal["off", "every", "selective"] | PositiveInt = "off"
    # tokens per chunk of the output projection + loss, which then never makes the whole (tokens x vocab)
    # logits (trainers/loss.py); 0 = whole logits
    loss_chunk: NonNegativeInt = 0
    # auto: before the model is built, choose micro-batch size, activation checkpointing and loss chunking
    # from the planner so the step fits `device_memory` (the global batch is kept; trainers/autofit.py)
    fit: Literal["off", "auto"] = "off"
    # what memory.fit may plan for, per rank, e.g. 80GiB or 512MiB; unset: the device's own figure (CUDA:
    # its total memory; CPU: the memory available now, shared by this node's ranks)
    device_memory: str | None = None

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _yaml_words(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False and `on` as True.
        if v is False or v is None or v == 0:
            return "off"
        if v is True or v == 1:
            return "every"
        return v

    @property
    def ac_every(self) -> int:
        """Full checkpointing: 0 = off (or selective), else the blocks whose index is a multiple of this."""
        ac = self.activation_checkpointing
        return 0 if ac in ("off", "selective") else 1 if ac == "every" else int(ac)

    @property
    def ac_selective(self) -> bool:
        return self.activation_checkpointing == "selective"

    @field_validator("fit", mode="before")
    @classmethod
    def _fit_words(cls, v: Any) -> Any:
        return "off" if v is False or v is None else v

    @field_validator("device_memory", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return checked_size(v, "memory.device_memory")  # a size the planner reads: checked here, before any worker


MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "interleaved_zb", "zbv")
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zb", "zbv")  # zero-bubble: input and weight gradients apart


class ParallelConfig(StrictModel):
    """How the model is sharded over the data-parallel ranks (the world size comes from the launcher)."""

    engine: Literal["none", "ddp", "fsdp", "deepspeed"] = Field(
        "none", description="none: one process; ddp; fsdp (FSDP2, also pp/tp/ep); deepspeed (ZeRO)"
    )
    # ZeRO stage. fsdp: 2 = parameters stay gathered from forward to backward (reshard_after_forward=False),
    # 3 = resharded after forward; deepspeed: its stage 0-3. None = the engine's default (fsdp 3, deepspeed 2).
    zero_stage: int | None = None
    # none | optimizer (deepspeed: optimizer state and step on CPU) | all (fsdp: params, grads and optimizer
    # on CPU; deepspeed stage 3: optimizer and parameters on CPU)
    offload: Literal["none", "optimizer", "all"] = "none"
    deepspeed_extra: dict[str, Any] = {}  # merged last into the generated DeepSpeed config (escape hatch)
    # Pipeline, tensor and expert parallelism (engine fsdp): world size = pp x data-parallel size x tp; ep
    # divides the data-parallel size and model.moe.num_experts. Every rule: trainers/layout.py.
    pp: PositiveInt = 1  # pipeline-parallel degree (ranks per pipeline)
    tp: PositiveInt = 1  # tensor-parallel degree: heads, FFN units and vocabulary split over tp ranks
    ep: PositiveInt = 1  # expert-parallel degree: each MoE layer's experts sharded over ep data-parallel ranks
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv"] = Field(
        "1f1b", description="torch.distributed.pipelining schedule (pp > 1)"
    )
    virtual_stages: PositiveInt = 1  # pipeline stages per rank (interleaved_*: >= 2; zbv: 2)
    n_microbatches: PositiveInt | None = None  # pipeline microbatches per step; None = the accumulation count
    # fsdp without a pipeline, when a step has several micro-batches per rank. sharded (the default):
    # every micro-batch's gradients are reduce-scattered and accumulated in the shards, so a rank never
    # holds more than ZeRO's 4P/N of gradients (one reduce-scatter per micro-batch). unsharded: whole fp32
    # gradients are kept between micro-batches and reduce-scattered once per step (4P more per rank, 1/k
    # of the gradient traffic). A pipeline schedule always reduces once per step.
    grad_accumulation: Literal["sharded", "unsharded"] | None = None

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        stage, engine = self.zero_stage, self.engine
        if stage is not None and stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={stage} is unknown; fix: use 0, 1, 2 or 3")
        if engine in ("none", "ddp") and stage not in (None, 0):
            raise ValueError(
                f"zero_stage={stage} needs a sharding engine; fix: set engine to fsdp or deepspeed"
            )
        if engine in ("none", "ddp") and self.offload != "none":
            raise ValueError(
                f"offload={self.offload} is not available with engine={engine}; fix: use engine fsdp or deepspeed"
            )
        if engine == "fsdp" and stage not in (None, 2, 3):
            raise ValueError(f"zero_stage={stage} with engine=fsdp; fix: use 2 or 3, or engine=ddp/deepspeed")
        if engine == "fsdp" and self.offload == "optimizer":
            raise ValueError(
                "offload=optimizer with engine=fsdp; fix: offload=all (FSDP2 offloads params, grads and "
                "optimizer state together) or engine=deepspeed"
            )
        if engine == "deepspeed" and self.offload == "all" and self.stage != 3:
            raise ValueError(
                f"offload=all needs zero_stage=3 with deepspeed (got {self.stage}); fix: set zero_stage=3"
            )
        if self.grad_accumulation is not None and engine != "fsdp":
            raise ValueError(
                f"grad_accumulation={self.grad_accumulation} needs engine=fsdp (DDP keeps whole gradients, "
                f"DeepSpeed's zero_stage decides); fix: remove it or set engine=fsdp"
            )
        if self.grad_accumulation == "sharded" and self.pp > 1:
            raise ValueError(
                "grad_accumulation=sharded with pp > 1: the pipeline schedule reduces gradients once per step; "
                "fix: remove it"
            )
        if self.deepspeed_extra and engine != "deepspeed":
            raise ValueError(
                "deepspeed_extra is set but engine is not deepspeed; fix: remove it or set engine"
            )
        return self

    @property
    def sharded_accumulation(self) -> bool:
        """FSDP reduce-scatters every micro-batch's gradients (see `grad_accumulation`)."""
        return self.engine == "fsdp" and self.pp == 1 and self.grad_accumulation != "unsharded"

    @property
    def stage(self) -> int:
        if self.zero_stage is not None:
            return self.zero_stage
        return {"fsdp": 3, "deepspeed": 2}.get(self.engine, 0)


class TrainConfig(StrictModel):
    steps: PositiveInt = 100  # optimizer steps
    global_batch_size: PositiveInt = 8  # samples per optimizer step, the same at any world size
    micro_batch_size: PositiveInt = 8  # samples per forward/backward on one rank
    eval_every: NonNegativeInt = 50  # 0 = only at the end
    eval_batches: PositiveInt = 8  # x micro_batch_size validation windows, in total over all ranks
    log_every: PositiveInt = 10  # progress line / bar refresh
    max_bad_steps: PositiveInt = 3  # consecutive NaN/inf losses tolerated (skipped) before stopping
    peak_tflops: PositiveFloat = 1.0  # per device, for MFU (e.g. 989 for H100 bf16 dense)
    tensorboard: bool = Field(True, description="also write the scalars for TensorBoard to RUN_DIR/tb/")
    compile: bool = False  # torch.compile each block (inductor, CPU and GPU), after TP and AC, before FSDP

    def accumulation(self, dp: int) -> int:
        """Micro-batches per rank per step so that micro x accumulation x dp == global batch."""
        per_step = self.micro_batch_size * dp
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                f"train.micro_batch_size={self.micro_batch_size} x data-parallel size {dp}; fix: use a "
                f"global batch that is a multiple of {per_step} or a micro_batch_size dividing "
                f"{self.global_batch_size // dp if self.global_batch_size % dp == 0 else 'it'}"
            )
        return self.global_batch_size // per_step


class CheckpointConfig(StrictModel):
    every: NonNegativeInt = 0  # save every N steps (0 = only at the end)
    final: bool = True  # also save at the end of the run (false with every 0: never, as a benchmark's run)
    keep: PositiveInt = 3  # newest complete checkpoints kept on disk (newest by commit, not by step)
    resume: str = "auto"  # auto (latest in run_dir, if any) | none | a checkpoint directory
    # async: a save blocks training only while the state is copied to host memory, then is written, checked
    # and committed in the background (one at a time); sync: training waits for the whole save
    mode: Literal["async", "sync"] = "async"
    threads: NonNegativeInt = 0  # writer/reader/checksum threads per rank (0: the host's cores, at most 8)


class ScalingConfig(StrictModel):
    """Workers of a run on Ray (`raytrain train`); torchrun and single-process runs ignore it.

    A fixed size is `num_workers: N`; an elastic run gives `min_workers`/`max_workers` and Ray restarts
    the worker group at the new size when workers are lost or resources appear."""

    num_workers: PositiveInt | None = None  # fixed size (default 1 when no min/max is given)
    min_workers: PositiveInt | None = None  # elastic: start as soon as this many fit
    max_workers: PositiveInt | None = None  # elastic: grow up to this many
    use_gpu: bool = False  # one GPU per worker
    cpus_per_worker: PositiveFloat = Field(1.0, description="CPUs Ray reserves for each worker")
    max_failures: int = Field(3, ge=-1)  # worker-group restarts after a failure (-1 = unlimited)
    resize_check_s: PositiveFloat = 60.0  # how often an elastic run looks for room to grow
    placement_timeout_s: PositiveFloat = 600.0  # no worker placed within this long: end with what was asked
    # none: a lost worker restarts the whole group from the newest committed checkpoint. per_step: the workers
    # form torchft replica groups; the others train on through a loss and a new one heals from a peer's memory
    # (`pip install 'raytrain-ext[ft]'`; rules and semantics: trainers/fault_tolerance.py, docs/ray-and-elasticity.md)
    fault_tolerance: Literal["none", "per_step"] = "none"
    # per_step: the workers of each replica group, which hold the model's FSDP shards (parallel.engine=fsdp);
    # 1: each worker a group
    workers_per_group: PositiveInt = 1
    # per_step: how long a step's gradient all-reduce waits for a slow group before it gives up and the step is
    # trained again without it; keep it above the longest normal wait (the slowest group's lag in a step, the
    # all-reduce itself). A group the lighthouse stops hearing from (a host cut off) is given up on once it says
    # so (1.5 s), on CPU; on CUDA at this timeout
    allreduce_timeout_s: PositiveFloat = 10.0

    @model_validator(mode="after")
    def _sizes(self) -> ScalingConfig:
        elastic = self.min_workers is not None or self.max_workers is not None
        if elastic and self.num_workers is not None:
            raise ValueError(
                "scaling: num_workers and min_workers/max_workers both set; fix: give num_workers for a "
                "fixed size, or min_workers and max_workers for an elastic run"
            )
        if elastic and (self.min_workers is None or self.max_workers is None):
            raise ValueError("scaling: an elastic run needs both min_workers and max_workers; fix: set both")
        if elastic and self.min_workers > self.max_workers:
            raise ValueError(
                f"scaling.min_workers={self.min_workers} > scaling.max_workers={self.max_workers}; "
                f"fix: swap them"
            )
        return self

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None and self.min_workers != self.max_workers

    @property
    def sizes(self) -> range:
        """Every world size the run may have."""
        fewest = self.min_workers or self.num_workers or 1
        return range(fewest, (self.max_workers or fewest) + 1)


class RunConfig(StrictModel):
    name: str = Field("run", description="the run's name: runs/<name> when run_dir is not set")
    seed: int = Field(0, description="model initialisation and data order")
    run_dir: Location = None  # None = runs/<name>; a local folder or a URI (s3://bucket/runs/x, gs://...)
    model: ModelConfig = ModelConfig()
    data: DataConfig
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: LRScheduleConfig = LRScheduleConfig()  # the YAML key stays `schedule`
    precision: PrecisionConfig = PrecisionConfig()
    memory: MemoryConfig = MemoryConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    scaling: ScalingConfig = ScalingConfig()
    tracking: TrackingConfig = TrackingConfig()  # MLflow / W&B (trainers/tracking/)
    profile: ProfileConfig = ProfileConfig()  # torch.profiler traces of chosen steps (trainers/profiling.py)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        """Cross-section checks, all in one place."""
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
                f"fix: raise model.max_seq_len or lower data.seq_len"
            )
        self.train.accumulation(1)  # a global batch that micro-batches cannot make raises with the numbers
        check_layout(self)
        if self.schedule.warmup_steps >= self.train.steps and self.schedule.name != "constant":
            raise ValueError(
                f"schedule.warmup_steps={self.schedule.warmup_steps} >= train.steps={self.train.steps}; "
                f"fix: shorten the warmup"
            )
        prof = self.profile
        if prof.start_step is None and prof.memory_snapshot:
            raise ValueError(
                "profile.memory_snapshot=true needs profiled steps; fix: add --profile STEP:COUNT "
                "(or set profile.start_step)"
            )
        if prof.start_step is not None and prof.start_step + prof.steps - 1 > self.train.steps:
            raise ValueError(
                f"profile.start_step={prof.start_step} with profile.steps={prof.steps} ends past "
                f"train.steps={self.train.steps}; fix: profile earlier steps, e.g. --profile 2:3"
            )
        return self

    @property
    def out_dir(self) -> Path:
        """`run_dir`, else RAYTRAIN_STORAGE/runs/<name> (a cluster's bucket: clusters/*.yaml), else runs/<name>."""
        if self.run_dir is not None:
            return self.run_dir
        from trainers.storage import default_root

        return default_root("runs") / self.name

    def to_yaml(self) -> str:
        return yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False)


# ---------------------------------------------------------------------- layout rules without a world size


def check_layout(cfg: RunConfig) -> None:
    """The layout rules that need no world size (degrees against the model, engine, schedule and precision),
    run on every load; `trainers.layout.check_config` is this function, the rules at a world size its own."""
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
    if cfg.train.compile and par.engine == "deepspeed" and par.stage == 3:
        # also: guarding the hooks' modules' ds_id ints runs into dynamo's recompile limit
        raise ConfigError(
            "train.compile=true with parallel.engine=deepspeed at zero_stage=3: ZeRO-3's parameter hooks on "
            "every submodule break each compiled block into pieces; fix: use parallel.engine=fsdp (FSDP2 "
            "shards as ZeRO-3 and compiles whole blocks), parallel.zero_stage=2, or train.compile=false"
        )
    if par.ep > 1 and model.moe is None:
        raise ConfigError(f"parallel.ep={par.ep} needs an MoE model; fix: set model.moe or parallel.ep=1")
    if par.ep > 1 and model.moe.num_experts % par.ep:
        raise ConfigError(
            f"parallel.ep={par.ep} does not divide model.moe.num_experts={model.moe.num_experts}; "
            f"fix: use an ep that divides it"
        )
    if par.tp > 1:
        _check_tp(par.tp, model, cfg.data.seq_len, cfg.precision.dtype)


def _check_tp(tp: int, model: ModelConfig, seq_len: int, dtype: str) -> None:
    """Tensor parallelism over `tp` ranks splits heads, the FFN's hidden units and each sequence of `seq_len`
    tokens into tp equal parts (the vocabulary as torch.chunk splits it: 257 into 129 + 128)."""
    sizes = [("model.n_heads", model.n_heads), ("the KV heads (model.n_kv_heads)", model.kv_heads)]
    sizes += [("the FFN hidden size", model.hidden_dim)]
    for what, size in sizes:
        if size % tp:
            divisors = [d for d in range(2, size + 1) if size % d == 0][:6]
            raise ConfigError(
                f"parallel.tp={tp} does not divide {what} = {size} (tensor parallelism splits it into tp "
                f"equal parts); fix: use tp in {divisors or [1]} or change the model"
            )
    if seq_len % tp:
        raise ConfigError(
            f"parallel.tp={tp} does not divide data.seq_len={seq_len} (sequence parallelism splits "
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
    if dtype == "fp16":
        raise ConfigError(
            "precision.dtype=fp16 with parallel.tp > 1 (the loss scaler does not see tensor-parallel "
            "gradients); fix: use precision.dtype=bf16 or fp32"
        )


def num_stages(pp: int, virtual_stages: int, pipeline_schedule: str) -> int:
    """Pipeline stages in all: pp x stages per rank (zbv always runs two per rank)."""
    return pp * (2 if pipeline_schedule == "zbv" and pp > 1 else virtual_stages)


# --------------------------------------------------------------------------------------------- loading


def read_yaml_mapping(path: str | Path, what: str, sections: str) -> dict[str, Any]:
    """A YAML file holding a mapping, or a one-line ConfigError naming the file and the fix."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file {path} not found; fix: pass the path of a {what} YAML")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping ({sections})")
    return raw


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a run YAML, apply `a.b=c` overrides, validate. Raises ConfigError (one line)."""
    raw = read_yaml_mapping(path, "run", "of sections: model:, data:, ...")
    return parse_config(apply_overrides(raw, overrides))


def parse_config(raw: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e, RunConfig)) from None


# What a running trainer can take on (`Trainer.set_hparams`): a PBT exploit's, a replay's, live values.
HPARAM_PREFIXES = ("optimizer.", "schedule.")


def check_hparam_keys(values: dict[str, Any]) -> None:
    """ConfigError naming the keys of `values` that a running trainer cannot take on."""
    fixed = sorted(k for k in values if not k.startswith(HPARAM_PREFIXES))
    if fixed:
        raise ConfigError(
            f"{', '.join(fixed)} cannot change in a running trainer (only optimizer.* and schedule.*); fix: "
            f"start a new run from the checkpoint"
        )


def with_values(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """`cfg` with dotted run-config keys set to Python values ({"optimizer.lr": 1e-3}), validated anew."""
    raw = cfg.model_dump(mode="json")
    for key, value in values.items():
        *path, name = key.split(".")
        node = raw
        for part in path:
            node = node[part]
        node[name] = value
    return parse_config(raw)


def apply_overrides(
    raw: dict[str, Any], overrides: list[str] | tuple[str, ...], flat: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`--set optimizer.lr=1e-3` -> raw['optimizer']['lr'] = 0.001 (values parsed as YAML). Under a section
    named in `flat` the rest of the key is one key (an experiment's space maps dotted run-config keys):
    `--set space.optimizer.lr=...` -> raw['space']['optimizer.lr']."""
    out = json.loads(json.dumps(raw, default=str))
    for item in overrides:
        key, sep, value = item.partition("=")
        parts = key.strip().split(".")
        if parts[0] in flat and len(parts) > 1:
            parts = [parts[0], ".".join(parts[1:])]
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is not KEY=VALUE; fix: e.g. --set optimizer.lr=1e-3")
        if not all(parts):
            raise ConfigError(f"--set {item!r}: the key has an empty part; fix: a dotted key, e.g. optimizer.lr")
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if nxt is None:  # a section left empty (`wandb:` or `moe: null`) is filled in
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: {p} is not a section; fix: check the key path")
            node = nxt
        node[parts[-1]] = _yaml_value(key.strip(), value)
    return out


def _yaml_value(key: str, value: str) -> Any:
    if not value.strip():
        return None
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(
            f"--set {key}={value}: the value is not valid YAML ({str(e).splitlines()[0]}); fix: write a YAML "
            f"value, e.g. 1e-3, [a, b] or {{loguniform: [1e-4, 1e-2]}}, quoted for the shell"
        ) from None


def _one_line(err: ValidationError, root: type[BaseModel]) -> str:
    e = err.errors()[0]
    loc = [str(p) for p in e["loc"] if not isinstance(p, int)]
    path = ".".join(loc) or "<root>"
    if e["type"] == "extra_forbidden":
        valid = _fields_at(root, loc[:-1])
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"did you mean '{'.'.join(loc[:-1] + close)}'?" if close else f"valid keys: {', '.join(valid)}"
        return f"unknown key '{path}'; fix: {hint}"
    if e["type"] == "missing":
        return f"missing key '{path}'; fix: add it to the YAML or pass --set {path}=..."
    msg = e["msg"].removeprefix("Value error, ")
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if e["type"] == "value_error":  # our validators: "key=value ...; fix: ..."
        m = re.match(r"([A-Za-z_][\w.]*)=", msg)
        if m and "." not in m.group(1) and loc:
            msg = f"{path}.{msg}"
        return msg + more
    got = f"={e['input']!r}" if "input" in e and not isinstance(e["input"], dict) else ""
    return f"{path}{got}: {msg}; fix: change {path} in the YAML or pass --set {path}=...{more}"


def _fields_at(root: type[BaseModel], loc: list[str]) -> list[str]:
    """Valid keys of the (possibly optional) sub-model found at `loc` under `root`."""
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part)
        model = _model_type(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields)


def _model_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = (_model_type(arg) for arg in getattr(annotation, "__args__", ()))
    return next((model for model in found if model is not None), None)
