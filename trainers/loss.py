"""The language-model loss: next-token cross-entropy in fp32, whole or chunked.

`lm_loss(logits, targets)` takes the model's (B, S, V) logits. At a GPT-2-sized vocabulary those logits
are the largest tensor of a small model's step (tokens x 50,257, in fp32 for the softmax, and again for
backward), so `chunked_lm_loss(hidden, weight, targets, chunk)` never makes them: it runs the output
projection and the cross-entropy over `chunk` tokens at a time and, as Liger's fused linear
cross-entropy does, computes the gradients of each chunk in the forward pass (softmax - one-hot, times
the weight and the hidden states), so only the (chunk x V) logits of one chunk are ever alive and nothing
of size V per token is saved for backward. Backward then only scales the saved gradients. Numerically it
is the same sum as the whole loss (fp32 logits and softmax), in another order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["chunked_lm_loss", "lm_loss"]


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy (in fp32) of logits (B, S, V) against targets (B, S)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def chunked_lm_loss(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, `chunk` tokens at a time.
    hidden: (..., d) final hidden states; weight: (V, d) the output projection; targets: (...)."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not torch.is_grad_enabled():  # evaluation: the loss alone, still one chunk of logits at a time
        return _chunked_forward(hidden, weight, targets, chunk, False, False)[0]
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk)


def _chunked_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, want_h: bool, want_w: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The mean loss and, where wanted, its gradients with respect to `hidden` and `weight`."""
    with torch.autocast(hidden.device.type, enabled=False):  # fp32 logits and softmax, as lm_loss
        return _chunks(hidden, weight, targets, chunk, want_h, want_w)


def _chunks(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, want_h: bool, want_w: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    n = hidden.shape[0]
    grad_h = torch.empty_like(hidden) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
    w = weight.float()
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk):
        h, t = hidden[start : start + chunk].float(), targets[start : start + chunk]
        logits = h @ w.t()  # (c, V) fp32: the only vocabulary-sized tensor, one chunk at a time
        lse = torch.logsumexp(logits, dim=-1)
        total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
        if want_h or want_w:
            # d(mean loss)/d(logits) = (softmax - one-hot) / n, made in place of the logits
            grad = logits.sub_(lse[:, None]).exp_()
            grad[torch.arange(len(t), device=t.device), t] -= 1.0
            grad.div_(n)
            if want_h:
                grad_h[start : start + chunk] = (grad @ w).to(hidden.dtype)
            if want_w:
                grad_w.addmm_(grad.t(), h)
        del logits
    return total / n, grad_h, grad_w


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, grad_w = _chunked_forward(hidden, weight, targets, chunk, want_h, want_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * grad_out.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_out).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None
