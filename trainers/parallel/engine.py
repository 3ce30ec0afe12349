"""The small interface the Trainer drives, whatever shards the model.

An engine owns where the model lives, the optimizer, precision (autocast and loss scaling), gradient
sync across data-parallel ranks, and the checkpoint format. The base class is the single-process
engine; sharded engines override what differs (`wrap`, `no_sync`, `reduce_mean`, checkpoint format).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

from trainers.checkpoint import CheckpointBackend, DCPBackend, ModelOptimizerState
from trainers.checkpoint_files import STATE_KEY
from trainers.config import OptimizerConfig, RunConfig
from trainers.layout import ParallelLayout
from trainers.models.moe import moe_stats, reset_moe_stats, set_aux_grad_scale
from trainers.optim import apply_hparams, build_optimizer
from trainers.precision import Precision
from trainers.profiling import span

__all__ = ["Batch", "Engine", "LocalEngine", "plain"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets) of one micro-batch, on the engine's device


class Engine:
    """Single process, whole model: the defaults every engine starts from."""

    name = "none"
    dp_rank: int = 0
    dp_size: int = 1
    world_size: int = 1

    def __init__(self, device: torch.device | None = None, layout: ParallelLayout | None = None):
        self.device = device or torch.device("cpu")
        self.layout = layout or ParallelLayout.build(1, 0, device_type=self.device.type)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    @property
    def is_main(self) -> bool:
        return self.dp_rank == 0

    # True: `setup` takes a meta-device model and shards it; `materialize` then allocates this rank's
    # part (model.init_from). False: the model must be whole and materialised before `setup`.
    shards_meta_models = False

    def materialize(self) -> None:
        raise NotImplementedError(f"engine {self.name} needs a materialised model before setup")

    # ---------------------------------------------------------------------------------------- setup

    def setup(self, model: nn.Module, cfg: RunConfig) -> None:
        """Place/shard the model, then build the optimizer over the (possibly sharded) parameters."""
        self.precision = Precision(cfg.precision, self.device)
        self.model = self.wrap(model, cfg)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)

    def wrap(self, model: nn.Module, cfg: RunConfig) -> nn.Module:
        """The model on this engine's device with parallelism applied (`trainers.parallel.parallelize`)."""
        from trainers.parallel.parallelize import parallelize

        return parallelize(model.to(self.device), self.layout, cfg)

    # ----------------------------------------------------------------------------------------- step

    def autocast(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast()

    @property
    def loss_scale(self) -> float:
        return self.precision.loss_scale

    def forward_backward(self, batches: Iterable[Batch], count: int) -> torch.Tensor:
        """Forward and backward over this step's `count` micro-batches on this rank, gradients accumulated
        (and synced on the final one). Returns this rank's mean loss, detached. The model computes its
        loss from the targets (`Transformer.forward(tokens, targets)`, chunked where configured); a
        pipeline engine runs its schedule here instead."""
        reset_moe_stats(self.model)
        set_aux_grad_scale(self.model, self.loss_scale / count, self.device)
        loss_sum = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(batches):
            with self.loss_context():
                with span("forward"):
                    with self.autocast():
                        loss = self.model(inputs, targets)
                with span("backward"):
                    self.backward(loss / count, final_micro_batch=i == count - 1)
            loss_sum += plain(loss.detach())
        return loss_sum / count

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Around each loss and its backward: `loss_parallel` when tensor parallelism shards the logits."""
        if self.layout.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    @torch.no_grad()
    def eval_loss(self, batches: Iterable[Batch]) -> torch.Tensor:
        """Sum over `batches` of mean loss x batch size, on this rank (model in eval mode meanwhile)."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for inputs, targets in batches:
            with self.autocast(), self.loss_context():
                total += plain(self.model(inputs, targets)) * len(inputs)
        self.model.train()
        return total

    def moe_stats(self) -> dict[str, Any]:
        """Router statistics of this step (see `trainers.models.moe_stats`); {} for a dense model."""
        return moe_stats(self.model)

    def backward(self, loss: torch.Tensor, final_micro_batch: bool) -> None:
        """`loss` is already divided by the number of micro-batches; grads sync on the final one."""
        with self.no_sync(final_micro_batch):
            self.precision.backward(loss)

    def no_sync(self, final_micro_batch: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def step(self, max_norm: float | None) -> tuple[float, bool]:
        """Clip and step. Returns (grad norm, bad): bad = non-finite gradients that no loss scaler
        handles (the step is skipped); fp16 overflows are the scaler's to skip and are not bad."""
        norm = self.precision.clip(self.optimizer, self.model.parameters(), max_norm)
        if not math.isfinite(norm) and self.precision.scaler is None:
            return norm, True
        self.precision.step(self.optimizer)
        return norm, False

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def apply_hparams(self, cfg: OptimizerConfig) -> None:
        apply_hparams(self.optimizer, cfg)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def eval_shard(self) -> tuple[int, int]:
        """(rank, ranks) that split the validation windows."""
        return self.dp_rank, self.dp_size

    # ------------------------------------------------------- per-step fault tolerance (no-ops but there)
    # A replica-group engine (`trainers.parallel.replicas`) forms a quorum of the live groups at every step.

    replicas: int | None = None  # live replica groups of this step (metrics.jsonl's `replicas`)
    group_rank = 0  # this worker's rank in its replica group (a group of several shards the model)
    saves = True  # whether this process takes part in a checkpoint (every rank does: saves are collective)

    def join(self, trainer_state: Any) -> bool:
        """The first quorum; True when this process took its state from a live peer instead of a checkpoint."""
        return False

    def committed_step(self, step: int) -> None:
        """The step the trainer restored (or starts at)."""

    def begin_step(self) -> None:
        """Before a step reads its samples (its quorum: `dp_rank`/`dp_size` may change)."""

    def take_heal(self) -> dict[str, Any] | None:
        """A heal in a step's quorum since the last call (a group that fell behind the others: a straggler, or
        one cut off and back): from which group, at which step, how long. The first quorum's is `join`'s."""
        return None

    def should_commit(self) -> bool:
        """After the step's gradients are averaged: False, and the step is trained again."""
        return True

    def close(self) -> None:
        """Release what `setup` acquired beyond the model (e.g. a process group the engine started)."""

    # ----------------------------------------------------------------------------------- checkpoint

    checkpoint_backend: CheckpointBackend = DCPBackend()

    def checkpoint_state(self, with_optimizer: bool = True) -> dict[str, Stateful]:
        return {STATE_KEY: ModelOptimizerState(self.model, self.optimizer, with_optimizer)}

    def extra_state(self) -> dict[str, Any]:
        """JSON-able engine state saved next to the tensors (the fp16 loss scaler)."""
        return {"scaler": self.precision.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state.get("scaler", {}))


class LocalEngine(Engine):
    pass


def plain(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (under tensor parallelism it is a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value
