"""DeepSpeed ZeRO (stages 0-3, CPU offload) behind the Engine interface.

The DeepSpeed config is generated from the run YAML (`deepspeed_config`); `parallel.deepspeed_extra` is
merged last and may add keys but not contradict the ones the run config owns. The Trainer's optimizer and
closed-form LR schedule drive DeepSpeed's optimizer: no DeepSpeed optimizer or scheduler section.

Checkpoints are DeepSpeed's own files under `<step dir>/deepspeed/` (saved and loaded by explicit tag, so
the Checkpointer's `.partial` rename keeps them valid). A checkpoint whose ZeRO partitions were written at
another data-parallel size is converted once to DeepSpeed's universal format (`<step dir>/universal/`) and
loaded from there. Stages 1 and 2 load each other's checkpoints; stage 0, stages 1-2 and stage 3 do not mix.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainers._base import env_default
from trainers.checkpoint_files import (
    DEEPSPEED_PARTITION,
    DEEPSPEED_STAGE3_MODEL,
    DEEPSPEED_TAG,
    DEEPSPEED_UNIVERSAL_TAG,
)
from trainers.config import ConfigError, OptimizerConfig, RunConfig
from trainers.deepspeed_compat import loading_universal_checkpoint
from trainers.layout import ParallelLayout
from trainers.models.flops import param_count
from trainers.optim import apply_hparams, build_optimizer, param_groups
from trainers.parallel.engine import Engine
from trainers.precision import Precision

__all__ = ["DeepSpeedCheckpointBackend", "DeepSpeedEngine", "DeepSpeedState", "deepspeed_config"]

# DeepSpeed 0.19 calls two torch.distributed functions that torch 2.13 deprecates: a ZeRO-3 run's console got
# their FutureWarnings again at every step (two lines each, from every worker). Only DeepSpeed can act on them.
DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
warnings.filterwarnings("ignore", message=DEEPSPEED_DEPRECATIONS, category=FutureWarning)

TAG, UNIVERSAL_TAG = DEEPSPEED_TAG, DEEPSPEED_UNIVERSAL_TAG  # the step folder's sub-folders (checkpoint_files)

# Generated keys and the run-config key that sets each (named in the error when deepspeed_extra disagrees).
_OWNER = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / (train.micro_batch_size x processes)",
    "gradient_clipping": "optimizer.grad_clip",
    "zero_optimization.stage": "parallel.zero_stage",
    "zero_optimization.offload_optimizer.device": "parallel.offload",
    "zero_optimization.offload_param.device": "parallel.offload",
    "bf16.enabled": "precision.dtype",
    "fp16.enabled": "precision.dtype",
    "fp16.initial_scale_power": "precision.init_scale",
    "fp16.loss_scale_window": "precision.growth_interval",
    "zero_force_ds_cpu_optimizer": "optimizer.name",
    "zero_allow_untested_optimizer": "optimizer.name",
}
# Keys that would bypass the Trainer, and what to use instead.
_REFUSED = {
    "optimizer": "the run's optimizer section",
    "scheduler": "the run's schedule section",
    "managed_gradient_accumulation": "nothing: the engine marks the accumulation boundary",
    "checkpoint.load_universal": "nothing: a world-size change converts the checkpoint by itself",
}


# ----------------------------------------------------------------------------------------------- config


def deepspeed_config(cfg: RunConfig, dp: int) -> dict[str, Any]:
    """The DeepSpeed config of a run at data-parallel size `dp`. Raises ConfigError (one line)."""
    p, prec = cfg.parallel, cfg.precision
    stage = p.stage
    if p.offload != "none" and stage == 0:
        raise ConfigError(
            f"parallel.offload={p.offload} needs a ZeRO stage with deepspeed (got zero_stage=0); "
            f"fix: set parallel.zero_stage to 1, 2 or 3"
        )
    if cfg.optimizer.name == "adagrad" and cfg.optimizer.weight_decay > 0 and stage > 0:
        raise ConfigError(
            f"optimizer.name=adagrad with weight_decay>0 and deepspeed zero_stage={stage}: ZeRO rebuilds "
            f"Adagrad as one parameter group, which would decay norms and embeddings too; fix: use adamw, "
            f"weight_decay=0 or zero_stage=0"
        )
    if prec.dtype == "fp16" and stage == 0:
        # Its non-ZeRO fp16 optimizer (FP16_UnfusedOptimizer) unscales gradients that engine.backward never
        # scaled: every update shrinks by the loss scale.
        raise ConfigError(
            "precision.dtype=fp16 with deepspeed zero_stage=0: DeepSpeed 0.19 divides the gradients by a loss "
            "scale it never applied; fix: set parallel.zero_stage to 1, 2 or 3, or use parallel.engine=ddp"
        )
    power = math.log2(prec.init_scale)
    if prec.dtype == "fp16" and power != int(power):
        raise ConfigError(
            f"precision.init_scale={prec.init_scale} is not a power of 2, which DeepSpeed's fp16 loss scale "
            f"needs; fix: e.g. --set precision.init_scale={2.0 ** round(power)}"
        )
    offload_optimizer = "cpu" if p.offload in ("optimizer", "all") else "none"
    bucket = int(min(5e8, max(param_count(cfg.model), 1e6)))
    generated: dict[str, Any] = {
        "train_batch_size": cfg.train.global_batch_size,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.train.accumulation(dp),
        "gradient_clipping": cfg.optimizer.grad_clip or 0.0,
        "zero_optimization": {
            "stage": stage,
            "offload_optimizer": {"device": offload_optimizer},
            "offload_param": {"device": "cpu" if p.offload == "all" else "none"},
            # DeepSpeed's default buckets hold 5e8 elements (1.9 GB in fp32) whatever the model's size;
            # a bucket never needs to exceed the model (bench/README.md, "ZeRO model state per rank").
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "bf16": {"enabled": prec.dtype == "bf16"},
        "fp16": {"enabled": False},
        # With offload, Adam/AdamW step in DeepSpeed's CPU kernel; other optimizers in torch's, on the CPU.
        "zero_force_ds_cpu_optimizer": _uses_cpu_adam(cfg.optimizer),
        # DeepSpeed lists SGD and RMSprop as untested with ZeRO; like every optimizer the run config offers
        # they update element by element, so ZeRO's flat partitions change nothing.
        "zero_allow_untested_optimizer": True,
    }
    if prec.dtype == "fp16":  # dynamic loss scaling, as torch's GradScaler in the other engines
        generated["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": int(power),
            "loss_scale_window": prec.growth_interval,
        }
    _check_extra(p.deepspeed_extra, generated)
    return _merge(generated, p.deepspeed_extra)


def _uses_cpu_adam(cfg: OptimizerConfig) -> bool:
    return cfg.name in ("adam", "adamw")


def _check_extra(extra: dict[str, Any], generated: dict[str, Any], prefix: str = "") -> None:
    """deepspeed_extra may add keys; a key the run config sets must keep its value."""
    for key, value in extra.items():
        path, ours = f"{prefix}{key}", generated.get(key)
        if path in _REFUSED:
            raise ConfigError(
                f"parallel.deepspeed_extra.{path} is set by the trainer; fix: remove it and use "
                f"{_REFUSED[path]}"
            )
        if isinstance(value, dict) and (ours is None or isinstance(ours, dict)):
            _check_extra(value, ours or {}, f"{path}.")
        elif ours is not None and ours != value:
            owner = _OWNER.get(path, "the run config")
            raise ConfigError(
                f"parallel.deepspeed_extra.{path}={value!r} conflicts with {ours!r} from {owner}; "
                f"fix: remove it from deepspeed_extra and set {owner}"
            )


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# ----------------------------------------------------------------------------------------------- engine


class DeepSpeedEngine(Engine):
    """`deepspeed.initialize` over the running process group (a 1-process gloo group of its own when
    there is none; `close` ends it). The Trainer's calls map onto DeepSpeed's: every `backward` gets the
    loss already divided by the accumulation count (so DeepSpeed must not divide again) and marks the
    accumulation boundary on the final micro-batch; `step` is DeepSpeed's step at that boundary."""

    name = "deepspeed"

    def __init__(self, layout: ParallelLayout, device: torch.device | None = None):
        super().__init__(device, layout)
        self.dp_rank, self.dp_size, self.world_size = layout.dp_rank, layout.dp, layout.world_size
        self.checkpoint_backend = DeepSpeedCheckpointBackend()
        self.ds: Any = None  # deepspeed.DeepSpeedEngine
        self._owns_group = False
        self._env = contextlib.ExitStack()  # environment defaults held for the engine's life (until close)

    def setup(self, model: nn.Module, cfg: RunConfig) -> None:
        config = deepspeed_config(cfg, self.dp_size)
        from trainers.parallel.parallelize import parallelize

        parallelize(model, self.layout, cfg)  # activation checkpointing only: tp, ep and pp need fsdp
        self._start_group()
        # DeepSpeed reads LOCAL_RANK at initialize and, under ZeRO-3, at every forward: a process that no
        # launcher started (`python -m trainers train`, a notebook) gets it for the engine's life.
        self._env.enter_context(env_default("LOCAL_RANK", str(self.device.index or 0)))
        try:
            self._initialize(model, cfg, config)
        except BaseException:
            self.close()
            raise

    def _initialize(self, model: nn.Module, cfg: RunConfig, config: dict[str, Any]) -> None:
        # DeepSpeed picks its accelerator once, when first imported; told this engine's device, it does not
        # warn on a CPU machine that it "was unable to detect" a GPU. A user's own DS_ACCELERATOR wins.
        with env_default("DS_ACCELERATOR", self.device.type):
            import deepspeed
            from deepspeed.accelerator import get_accelerator

            get_accelerator()
        _skip_shm_comm_build()
        deepspeed.init_distributed(get_accelerator().communication_backend_name(), dist_init_required=False)
        self._check_accelerator(cfg)
        self._validate(config, cfg)
        self.precision = Precision(cfg.precision, self.device)  # autocast only: DeepSpeed scales fp16 losses
        optimizer = self._build_optimizer(model, cfg)
        self._decay = [g.get("decay", True) for g in optimizer.param_groups]
        half_without_zero = config["zero_optimization"]["stage"] == 0 and cfg.precision.dtype != "fp32"
        with _inert_init_step(optimizer, half_without_zero):
            self.ds, _, _, _ = deepspeed.initialize(
                model=model, optimizer=optimizer, config=config, dist_init_required=False
            )
        self.model = self.ds
        self.optimizer = self.ds.optimizer
        # Without ZeRO, bf16 or fp16 DeepSpeed steps our optimizer as it is and reports no grad norm.
        self._wrapped = self.ds.optimizer is not optimizer
        self.apply_hparams(cfg.optimizer)

    @property
    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer DeepSpeed steps: its param groups are the ones the LR schedule writes (ZeRO
        rebuilds an Adagrad it is given, so it is not always the one passed in)."""
        return getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)

    def _build_optimizer(self, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        if cfg.parallel.offload == "none" or not _uses_cpu_adam(cfg.optimizer):
            return build_optimizer(model, cfg.optimizer)
        # ZeRO-Offload steps on the CPU with DeepSpeed's vectorised Adam (a one-off JIT build of cpu_adam).
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        o = cfg.optimizer
        groups = [g for g in param_groups(model, o.weight_decay) if g["params"]]
        opt = DeepSpeedCPUAdam(groups, lr=o.lr, betas=o.betas, eps=o.eps, adamw_mode=o.name == "adamw")
        apply_hparams(opt, o)
        return opt

    def _check_accelerator(self, cfg: RunConfig) -> None:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        if cfg.precision.dtype == "fp16" and not acc.is_fp16_supported():
            raise ConfigError(
                f"precision.dtype=fp16: DeepSpeed does not support fp16 on this {acc.device_name()} device; "
                f"fix: use precision.dtype=bf16 or fp32"
            )

    def _validate(self, config: dict[str, Any], cfg: RunConfig) -> None:
        """DeepSpeed's own parse of the config; its complaints about deepspeed_extra become ConfigErrors."""
        from deepspeed.runtime.config import DeepSpeedConfig

        parsed = _ReadKeys(copy.deepcopy(config))
        try:
            DeepSpeedConfig(parsed)
        except Exception as e:  # noqa: BLE001 - pydantic, assertion and value errors alike
            if not cfg.parallel.deepspeed_extra:
                raise
            raise ConfigError(
                f"parallel.deepspeed_extra: DeepSpeed rejects the config ({_first_problem(e)}); fix: correct "
                f"or remove the key it names"
            ) from None
        # DeepSpeed ignores unknown top-level keys: catch misspellings (some real keys are read elsewhere).
        for key in cfg.parallel.deepspeed_extra:
            close = difflib.get_close_matches(key, parsed.read, n=1, cutoff=0.8)
            if key not in parsed.read and close:
                raise ConfigError(
                    f"parallel.deepspeed_extra.{key} is not a DeepSpeed config key; fix: did you mean "
                    f"'{close[0]}'?"
                )

    def _start_group(self) -> None:
        if dist.is_initialized():
            return
        if self.world_size > 1:
            raise RuntimeError(f"a layout of {self.world_size} processes but no process group")
        # DeepSpeed needs a process group even alone; an in-memory store needs no port or env vars.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._owns_group = True

    def close(self) -> None:
        """Ends the process group `setup` started (none when the launcher provided one) and undoes its
        environment defaults."""
        if self._owns_group and dist.is_initialized():
            import deepspeed.comm

            deepspeed.comm.destroy_process_group()  # also drops DeepSpeed's cached sub-groups
        self._owns_group = False
        self._env.close()

    # ----------------------------------------------------------------------------------------- step

    @property
    def loss_scale(self) -> float:
        return float(self.ds.optimizer.loss_scale) if self.ds.fp16_enabled() else 1.0

    def backward(self, loss: torch.Tensor, final_micro_batch: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(final_micro_batch)  # reduce (stage 0/1) on the final one
        self.ds.backward(loss, scale_wrt_gas=False)  # the Trainer already divided by the accumulation

    def step(self, max_norm: float | None) -> tuple[float, bool]:
        """DeepSpeed clips to `max_norm` (= optimizer.grad_clip, its gradient_clipping) and steps; returns
        its global grad norm. ZeRO skips steps with non-finite gradients itself; bf16 may not, so those
        are reported bad."""
        norm = None if self._wrapped else _grad_norm(self.ds.module.parameters())
        if norm is not None and not math.isfinite(norm):
            return norm, True
        self.ds.step()
        if norm is None:
            norm = self.ds.get_global_grad_norm()
            norm = math.nan if norm is None else float(norm)
        return norm, not math.isfinite(norm) and not self.ds.fp16_enabled()

    def zero_grad(self) -> None:
        self.ds.zero_grad()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._torch_optimizer.param_groups

    def apply_hparams(self, cfg: OptimizerConfig) -> None:
        for group, decay in zip(self.param_groups, self._decay):
            group["decay"] = decay  # groups DeepSpeed rebuilt (a universal restore, Adagrad) lack our flag
        apply_hparams(self._torch_optimizer, cfg)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return value
        out = value.detach().clone()
        dist.all_reduce(out)  # gloo has no AVG
        return out / self.dp_size

    # ----------------------------------------------------------------------------------- checkpoint

    def checkpoint_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        return {"deepspeed": DeepSpeedState(self.ds, with_optimizer)}

    def extra_state(self) -> dict[str, Any]:
        return {}  # the fp16 loss scaler is in DeepSpeed's own files

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass


class _ReadKeys(dict):
    """A config dict that remembers which top-level keys DeepSpeed's parser looked up."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.read: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)


def _first_problem(e: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(e, ValidationError):  # DeepSpeed's section models, e.g. DeepSpeedZeroConfig
        err = e.errors()[0]
        return f"{e.title}.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}"
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _grad_norm(params: Iterator[nn.Parameter]) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def _skip_shm_comm_build() -> None:
    """deepspeed.comm JIT-compiles its shared-memory all-reduce (~90 s of g++ on first use) when it wraps
    the process group; only tensor-parallel inference calls it (`inference_all_reduce`). DeepSpeed keeps
    this probe result in a module dict meant to be edited."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def _inert_init_step(optimizer: torch.optim.Optimizer, active: bool) -> Iterator[None]:
    """Without ZeRO, DeepSpeed's fp16/bf16 wrapper creates the optimizer state by stepping once with zero
    gradients (fp16/unfused_optimizer.py, initialize_optimizer_states): with torch's Adam that advances
    the bias-correction count and applies weight decay once. Make that step a no-op and forget its count."""
    if not active:
        yield
        return
    saved = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"], g["weight_decay"] = 0.0, 0.0
    try:
        yield
    finally:
        for g, (lr, wd) in zip(optimizer.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd
        for state in optimizer.state.values():
            if "step" in state:
                state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0


# ------------------------------------------------------------------------------------------ checkpoints


@dataclass
class DeepSpeedState:
    """What a DeepSpeed checkpoint holds: the engine's module, optimizer and loss-scaler state."""

    engine: Any  # deepspeed.DeepSpeedEngine
    with_optimizer: bool = True  # False: weights only (the run switched optimizer kind)


class DeepSpeedCheckpointBackend:
    """`save_checkpoint`/`load_checkpoint` by explicit tag; a load at another data-parallel size than the
    save goes through DeepSpeed's universal checkpoint (converted on rank 0, once per checkpoint)."""

    def save(self, path: Path, state: dict[str, Any], group: Any = None, threads: int = 1) -> None:
        state["deepspeed"].engine.save_checkpoint(str(path), tag=TAG)

    def load(self, path: Path, state: dict[str, Any], threads: int = 1) -> None:
        ds_state: DeepSpeedState = state["deepspeed"]
        engine, path = ds_state.engine, Path(path)
        if not (path / TAG).is_dir():
            raise ConfigError(
                f"checkpoint {path} was not written by the deepspeed engine; fix: resume it with the "
                f"parallel.engine that wrote it, or set checkpoint.resume=none"
            )
        saved, stage = SavedLayout.read(path / TAG), int(engine.zero_optimization_stage())
        if saved.stages != _stages(stage):
            raise ConfigError(
                f"checkpoint {path} was saved with ZeRO stage {saved.stages} and cannot resume at zero_stage="
                f"{stage} (DeepSpeed converts between world sizes and between stages 1 and 2 only); fix: "
                f"resume with the zero_stage it was saved at"
            )
        if saved.partitions in (0, engine.dp_world_size):
            self._load(engine, path, TAG, ds_state.with_optimizer)
            return
        _on_rank0(engine.device, to_universal, path)
        with loading_universal_checkpoint(engine):
            self._load(engine, path, UNIVERSAL_TAG, ds_state.with_optimizer)
        _unshare_step_counts(getattr(engine.optimizer, "optimizer", engine.optimizer))

    @staticmethod
    def _load(engine: Any, path: Path, tag: str, with_optimizer: bool) -> None:
        loaded, _ = engine.load_checkpoint(
            str(path),
            tag=tag,
            load_optimizer_states=with_optimizer,
            load_lr_scheduler_states=False,
            load_module_only=not with_optimizer,
        )
        if loaded is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint under {path / tag}")


def _unshare_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """ZeRO-3's universal load gives every sub-group one shared `step` tensor, which torch's Adam then
    advances in place once per sub-group per step (zero/stage3.py, load_hp_checkpoint_state_..._stage3)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


@dataclass(frozen=True)
class SavedLayout:
    """How a DeepSpeed checkpoint's files are split, from their names."""

    partitions: int  # data-parallel size of the ZeRO optimizer partitions (0: no ZeRO, loads at any size)
    stage3: bool  # parameters partitioned too

    @classmethod
    def read(cls, tag_dir: Path) -> SavedLayout:
        ranks = {int(m.group(2)) for f in tag_dir.glob("*.pt") if (m := DEEPSPEED_PARTITION.match(f.name))}
        return cls(len(ranks), any(tag_dir.glob(DEEPSPEED_STAGE3_MODEL)))

    @property
    def stages(self) -> str:
        return _stages(0 if self.partitions == 0 else 3 if self.stage3 else 1)


def _stages(stage: int) -> str:
    """ZeRO stages whose checkpoints load into each other: 1 and 2 share a format."""
    return {0: "0", 1: "1-2", 2: "1-2", 3: "3"}[stage]


def _on_rank0(device: torch.device, fn: Any, *args: Any) -> None:
    """`fn` on rank 0 while the others wait; a failure there fails every rank instead of hanging them."""
    ok = torch.ones(1, device=device)
    error = None
    if dist.get_rank() == 0:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            ok.zero_()
            error = e
    dist.broadcast(ok, src=0)
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError(f"{getattr(fn, '__name__', fn)}{args} failed on rank 0 (see its log)")


def to_universal(path: Path) -> Path:
    """Convert `path/TAG` to DeepSpeed's universal format in `path/UNIVERSAL_TAG` (atomic; kept for the
    next resharding load of the same checkpoint)."""
    out = path / UNIVERSAL_TAG
    if out.is_dir():
        return out
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    work = path / f"{UNIVERSAL_TAG}.partial"
    shutil.rmtree(work, ignore_errors=True)
    args = SimpleNamespace(
        input_folder=str(path / TAG),
        output_folder=str(work),
        num_extract_workers=1,  # no process pools forked from a process that holds a process group
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # the universal_checkpoint_info Megatron writes; plain models have none
    )
    ds_to_universal(args)
    os.replace(work, out)
    (path / "latest_universal").write_text(UNIVERSAL_TAG)  # ds_to_universal wrote the pre-rename name
    return out
