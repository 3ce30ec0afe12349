"""The small interface the Trainer drives, whatever shards the model.

An engine owns where the model lives and how data-parallel ranks agree: it wraps the model, says which
slice of a global batch this rank takes, skips gradient sync on non-final micro-batches and averages
metrics. `LocalEngine` is the single-process one; sharded engines implement the same methods.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

__all__ = ["Engine", "LocalEngine"]


class Engine:
    """No-op defaults: a single process that owns the whole model."""

    dp_rank: int = 0
    dp_size: int = 1
    world_size: int = 1

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.dp_rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def no_sync(self, model: nn.Module, final_micro_batch: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward: gradient sync only on the last one."""
        return contextlib.nullcontext()

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return value


class LocalEngine(Engine):
    pass
