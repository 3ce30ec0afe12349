"""Activation checkpointing, applied to a model from outside, per transformer block: full (recompute the
whole block in backward) or selective (keep what is costly to recompute, recompute the rest)."""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainers.torch_compat import HOP_WRAP_LOGGER, checkpoint_wrapper

__all__ = ["SAC_UNDER_COMPILE_WARNING", "apply_activation_checkpointing", "selective_policy"]

# torch.compile of a selectively checkpointed block logs, once a process, a 4-line warning that the region
# must hold no in-place op. Ours holds none on a tensor autograd sees (the MoE router's one `scatter_add_` is
# on a fresh integer tensor of counts; compiled blocks give eager's gradients under selective AC:
# tests/unit/test_moe_grouped.py, tests/unit/test_compile.py), so a user could not act on it: it is dropped
# at its logger, every other message of that logger kept.
SAC_UNDER_COMPILE_WARNING = "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile"


class _DropSacUnderCompile(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return SAC_UNDER_COMPILE_WARNING not in record.getMessage()


logging.getLogger(HOP_WRAP_LOGGER).addFilter(_DropSacUnderCompile())

# Outputs kept by selective checkpointing: the matmuls and attention (their FLOPs are the step's FLOPs);
# norms, SwiGLU's activation and products, RoPE, residual adds and casts are recomputed.
_SAVED = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
}


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torch's selective-checkpoint policy: save matmul and scaled-dot-product-attention outputs."""
    if op in _SAVED or "scaled_dot_product" in str(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, every: int, selective: bool = False) -> int:
    """Wrap blocks 0, k, 2k, ... of `model.layers` (k = `every`; 0 = off) so their activations are
    recomputed in backward instead of kept; `selective` wraps every block and keeps the matmul and
    attention outputs (torch's `create_selective_checkpoint_contexts`). Non-reentrant checkpointing (the one
    torch recommends; it composes with FSDP2, TP and autocast). Returns the number of blocks wrapped."""
    if every <= 0 and not selective:
        return 0
    options = {"context_fn": partial(create_selective_checkpoint_contexts, selective_policy)} if selective else {}
    wrapped = 0
    for name, block in list(model.layers.named_children()):
        if selective or int(name) % every == 0:
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False, **options))
            wrapped += 1
    return wrapped
