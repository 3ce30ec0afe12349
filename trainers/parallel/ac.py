"""Activation checkpointing, applied to a model from outside, per transformer block."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

__all__ = ["apply_activation_checkpointing"]


def apply_activation_checkpointing(model: nn.Module, every: int) -> int:
    """Wrap blocks 0, k, 2k, ... of `model.layers` (k = `every`; 0 = off) so their activations are
    recomputed in backward instead of kept. Non-reentrant checkpointing (the one torch recommends;
    it composes with FSDP2 and autocast). Returns the number of blocks wrapped."""
    if every <= 0:
        return 0
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if int(name) % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))
            wrapped += 1
    return wrapped
