"""The language-model loss: next-token cross-entropy with an fp32 softmax, whole or chunked.

`chunked_lm_loss` never makes the (tokens x V) logits, the largest tensor of a small model's step: as Liger's
fused linear cross-entropy, it runs the head and the cross-entropy `chunk` tokens at a time and computes each
chunk's gradients in forward, so backward only scales them. The numerics are the whole loss's: matmuls in its
head's dtype (autocast's, else the inputs'), softmax in fp32, the head weight's gradient summed in fp32 (as
Liger and Apple's Cut Cross-Entropy: fp32 matmuls would leave a GPU's tensor cores idle). On CUDA the chunks
run compiled, several a call (`_runner`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["CHUNK_BYTES", "chunk_tokens", "chunked_lm_loss", "compute_dtype", "lm_loss", "lm_loss_compiled"]

CHUNK_BYTES = 64 * 2**20  # one chunk's fp32 logits, what `chunk_tokens` aims for


def chunk_tokens(vocab_size: int, device_type: str = "cpu") -> int:
    """A chunk size for `chunked_lm_loss`: the power of two of tokens whose fp32 logits take at most
    CHUNK_BYTES (CUDA: 16x that), in [128, 4096]. Each chunk costs a GPU kernel launches and a pass over the
    head's fp32 gradient: chunk 256 took 1.6x chunk 4096's time on an H100."""
    budget = CHUNK_BYTES * (16 if device_type == "cuda" else 1)
    tokens = max(budget // (4 * vocab_size), 1)
    return min(max(1 << (tokens.bit_length() - 1), 128), 4096)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy (in fp32) of logits (B, S, V) against targets (B, S)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def lm_loss_compiled(logits: Tensor, targets: Tensor) -> Tensor:
    """`lm_loss` compiled by inductor on CUDA (`train.compile`; torchtitan compiles its loss too): one pass
    over the 16-bit logits and one back, where eager writes fp32 logits, their log_softmax and two fp32
    gradients (6 of a MoE step's 65 ms on an H200). `lm_loss` itself on a CPU, for the DTensor logits of
    tensor parallelism, and if compiling fails (`_GuardedCompile`)."""
    if isinstance(logits, DTensor) or logits.device.type != "cuda":
        return lm_loss(logits, targets)
    if "lm_loss" not in _COMPILED:
        _COMPILED["lm_loss"] = _GuardedCompile(lm_loss, "the loss")
    return _COMPILED["lm_loss"](logits, targets)


def chunked_lm_loss(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, `chunk` tokens at a time.
    hidden: (..., d) final hidden states; weight: (V, d) the output projection; targets: (...).
    A weight sharded on the vocabulary over a tensor-parallel mesh (a DTensor, Shard(0)) gives the
    vocabulary-parallel form (`_vocab_shard`)."""
    start, group = 0, None
    if isinstance(weight, DTensor):
        hidden, weight, start, group = _vocab_shard(hidden, weight)
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not torch.is_grad_enabled():  # evaluation: the loss alone, still one chunk of logits at a time
        return _chunks(hidden, weight, targets, chunk, False, False, start, group)[0]
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk, start, group)


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in on the whole-loss path: autocast's (bf16/fp16) when it is on for
    the device, else the inputs' (fp32; 16-bit weights under FSDP's param_dtype)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunks(
    hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, want_h: bool, want_w: bool,
    start: int = 0, group: Any = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The mean loss and, where wanted, its gradients with respect to `hidden` and `weight`: matmuls in
    `compute_dtype`, softmax in fp32 (`_chunk_step`). A process group: this rank's rows of the head, from
    row `start` (`_vp_chunks`)."""
    if group is not None:
        return _vp_chunks(hidden, weight, targets, chunk, start, group, want_h, want_w)
    n, vocab = hidden.shape[0], weight.shape[0]
    dtype = compute_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen above, once
        w = weight.to(dtype)  # autocast's cast of the head weight, made once
        pad = _vocab_padding(vocab, hidden.device.type)
        if pad:  # zero rows, every matmul's vocabulary dimension aligned (their logits out of the softmax)
            w = F.pad(w, (0, 0, 0, pad))
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=weight.device) if want_w else None
        scale = torch.full((), 1.0 / n, dtype=torch.float32, device=hidden.device)  # no recompile per n
        run, span = _runner(hidden.device, n, chunk, want_h or want_w)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for first in range(0, n, span):
            stop = first + span
            total += run(hidden[first:stop], w, targets[first:stop], scale, chunk, dtype, vocab,
                         grad_h[first:stop] if want_h else None, grad_w)
    return total / n, grad_h, grad_w[:vocab] if grad_w is not None and pad else grad_w


def _chunk_group(
    hidden: Tensor, w: Tensor, targets: Tensor, scale: Tensor, chunk: int, dtype: torch.dtype, vocab: int,
    grad_h: Tensor | None, grad_w: Tensor | None
) -> Tensor:
    """The summed loss of `hidden`'s tokens, `chunk` at a time (`_chunk_step`, in place); d(loss)/d(hidden)
    written into `grad_h`, d(loss)/d(w) added to `grad_w` (fp32), each where given. Eager."""
    total = None
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk].to(dtype), targets[start : start + chunk]
        loss_sum, grad = _chunk_step(h, w, t, scale, grad_h is not None or grad_w is not None, vocab)
        total = loss_sum if total is None else total + loss_sum
        if grad is not None:
            _backprop_chunk(grad_h, grad_w, grad, h, w, start)
            del grad
    return total


def _chunk_group_traced(
    hidden: Tensor, w: Tensor, targets: Tensor, scale: Tensor, chunk: int, dtype: torch.dtype, vocab: int,
    grad_h: Tensor | None, grad_w: Tensor | None
) -> Tensor:
    """`_chunk_group` for inductor: each chunk's step out of place (`_chunk_step_traced`, fused into a
    reduction and one pointwise pass over the 16-bit logits). The gradient is taken back by an op inductor
    runs in place (`raytrain::backprop_chunk_`: as `grad_w.add_` the sums were fused into one kernel at the
    end, keeping every chunk's product alive), whose zero feeds the next chunk's input, so that chunk's
    matmul cannot be scheduled before it: one chunk's logits alive at a time (tests/unit/test_loss.py)."""
    total = token = None
    for start in range(0, hidden.shape[0], chunk):
        h, t = hidden[start : start + chunk], targets[start : start + chunk]
        if token is not None:  # a 0-dim fp32 zero: h keeps its dtype; fused into the cast below where
            h = h + token  # autocast casts fp32 hidden states
        h = h.to(dtype)
        loss_sum, grad = _chunk_step_traced(h, w, t, scale, grad_h is not None or grad_w is not None, vocab)
        total = loss_sum if total is None else total + loss_sum
        if grad is not None:
            token = torch.ops.raytrain.backprop_chunk_(grad_h, grad_w, grad, h, w, start)
    return total


# cuBLAS runs 16-bit matmuls whose rows are not 16-byte aligned in older kernels (on an H200 the 50,257-row
# head's chunks took 12.5 of a step's 25 ms of kernel time, bench/results/gpu_profile.txt): on CUDA the
# chunked loss pads the head to a multiple of VOCAB_ALIGN rows, as nanoGPT pads its vocabulary to 50,304.
VOCAB_ALIGN = 64


def _vocab_padding(vocab: int, device_type: str) -> int:
    """Zero rows that bring the head's `vocab` rows to a multiple of VOCAB_ALIGN: on CUDA; 0 elsewhere."""
    return -vocab % VOCAB_ALIGN if device_type == "cuda" else 0


def _backprop_chunk(
    grad_h: Tensor | None, grad_w: Tensor | None, grad: Tensor, h: Tensor, w: Tensor, start: int
) -> Tensor:
    """A chunk's d(logits) written to its rows of `grad_h` and added to `grad_w`, each where given. As the op
    `raytrain::backprop_chunk_` inductor runs it in place, in order; the fp32 zero it returns orders the
    next chunk."""
    if grad_h is not None:
        rows = grad_h[start : start + grad.shape[0]]
        if rows.dtype == grad.dtype:
            torch.mm(grad, w, out=rows)
        else:  # fp32 hidden states under autocast: the 16-bit product, cast as it is written
            rows.copy_(grad @ w)
    if grad_w is not None and grad.dtype == grad_w.dtype:
        grad_w.addmm_(grad.t(), h)
    elif grad_w is not None:  # the chunk's product in the matmul's dtype, the sum over chunks in fp32
        grad_w.add_(grad.t() @ h)
    return torch.zeros((), dtype=torch.float32, device=h.device)


# A plain library op (torch.library.custom_op's wrapper costs ~10 us a call more, on each of 64 chunks).
_LIB = torch.library.Library("raytrain", "FRAGMENT")
_LIB.define("backprop_chunk_(Tensor(a!)? grad_h, Tensor(b!)? grad_w, Tensor grad, Tensor h, Tensor w, int start)"
            " -> Tensor")
_LIB.impl("backprop_chunk_", _backprop_chunk, "CompositeExplicitAutograd")


@torch.library.register_fake("raytrain::backprop_chunk_", lib=_LIB)
def _(grad_h: Tensor | None, grad_w: Tensor | None, grad: Tensor, h: Tensor, w: Tensor, start: int) -> Tensor:
    return torch.empty((), dtype=torch.float32, device=h.device)


def _chunk_step(
    h: Tensor, w: Tensor, t: Tensor, scale: Tensor, want_grad: bool, vocab: int | None = None
) -> tuple[Tensor, Tensor | None]:
    """One chunk: the summed loss and d(mean loss)/d(logits) = (softmax - one-hot) * scale, in the matmul's
    dtype; the softmax in fp32, as `lm_loss`'s `.float()`, in place: one (c x V) fp32 tensor alive. w's
    rows past `vocab` are padding (`_vocab_padding`): out of the softmax, their gradient columns zero."""
    full = (h @ w.t()).float()  # (c, V): the only vocabulary-sized tensors, one chunk at a time
    logits = full[:, :vocab]  # a view: the padding's columns are never read
    target_logit = logits.gather(1, t[:, None]).squeeze(1)
    mx = logits.amax(dim=-1)
    probs = logits.sub_(mx[:, None]).exp_()  # in place: logsumexp's steps without its temporaries
    sumexp = probs.sum(dim=-1)
    loss_sum = (mx + sumexp.log() - target_logit).sum()
    if not want_grad:
        return loss_sum, None
    grad = probs.div_(sumexp[:, None])
    grad[torch.arange(len(t), device=t.device), t] -= 1.0
    grad.mul_(scale)
    if vocab is not None and vocab < full.shape[1]:
        full[:, vocab:] = 0.0
    return loss_sum, full.to(h.dtype)  # fp32: the same tensor, no copy


def _chunk_step_traced(
    h: Tensor, w: Tensor, t: Tensor, scale: Tensor, want_grad: bool, vocab: int
) -> tuple[Tensor, Tensor | None]:
    """`_chunk_step` out of place, for inductor: the padding masked to -inf, the one-hot a comparison with
    the column index, so the max, sum of exponentials and target logit fuse into one reduction over the
    16-bit logits and the gradient into one pass that writes it in their dtype."""
    logits = (h @ w.t()).float()
    col = torch.arange(w.shape[0], device=h.device)
    if vocab < w.shape[0]:
        logits = torch.where(col < vocab, logits, float("-inf"))
    hit = col == t[:, None]
    mx = logits.amax(dim=-1, keepdim=True)
    exp = (logits - mx).exp()
    sumexp = exp.sum(dim=-1, keepdim=True)
    target_logit = torch.where(hit, logits, 0.0).sum(dim=-1, keepdim=True)  # in the reduction's pass
    loss_sum = (mx + sumexp.log() - target_logit).sum()
    if not want_grad:
        return loss_sum, None
    return loss_sum, ((exp / sumexp - hit.float()) * scale).to(h.dtype)


# On CUDA the chunks run compiled, CHUNKS_PER_CALL a call (`_chunk_group_traced`): a call per chunk left the
# step host-bound (25 ms of host time for 64 chunks against 22 ms of their kernels on an H200,
# bench/results/gpu_profile.txt). RAYTRAIN_LOSS_COMPILE=0 keeps the chunks eager (`_chunk_group`);
# RAYTRAIN_LOSS_CHUNKS_PER_CALL sets how many a compiled call takes (bench/gpu.py measures 1 against 8).
CHUNKS_PER_CALL = max(int(os.environ.get("RAYTRAIN_LOSS_CHUNKS_PER_CALL", "8")), 1)
_COMPILED: dict[str, Any] = {}


def _runner(device: torch.device, n: int, chunk: int, want_grad: bool) -> tuple[Callable[..., Tensor], int]:
    """The chunk-group function for `device` and how many tokens each call takes: eager, all `n` in one call
    (a CPU: a loop over the chunks), or compiled, CHUNKS_PER_CALL chunks a call (CUDA; one a call without
    gradients, as in evaluation: taking a chunk's gradient back is what orders the chunks of a call)."""
    if not _compiles(device):
        return _chunk_group, max(n, 1)
    if "chunks" not in _COMPILED:
        _COMPILED["chunks"] = _GuardedCompile(_chunk_group_traced, "the chunked loss", eager=_chunk_group)
    return _COMPILED["chunks"], chunk * (CHUNKS_PER_CALL if want_grad else 1)


def _compiles(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("RAYTRAIN_LOSS_COMPILE", "1") != "0"


class _GuardedCompile:
    """torch.compile of `fn` that falls back to `eager` (default: `fn` itself; once, with a warning) if
    compiling fails: the loss must not stop a run on a machine without a working Triton."""

    def __init__(self, fn: Callable[..., Any], what: str, eager: Callable[..., Any] | None = None):
        self.fn, self.compiled, self.what = eager or fn, torch.compile(fn, dynamic=False), what

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError:  # the memory's fault, not the compiler's: eager would need more
                raise
            except Exception as e:  # inductor/Triton missing or failing: eager is the same math
                warnings.warn(f"{self.what} runs eager: torch.compile failed ({type(e).__name__}: {e})",
                              stacklevel=2)
                self.compiled = None
        return self.fn(*args)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, start: int, group: Any
    ) -> Tensor:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, grad_w = _chunks(hidden, weight, targets, chunk, want_h, want_w, start, group)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None, None]:
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h * grad_out.to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_out).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None


# -------------------------------------------------------------------- vocabulary-parallel (tensor parallel)


def _vocab_shard(hidden: Tensor, weight: DTensor) -> tuple[Tensor, Tensor, int, Any]:
    """The whole sequence's hidden states, this rank's rows of the head, the first one's index and the mesh's
    process group: Megatron's vocabulary-parallel cross-entropy (`_vp_chunks`)."""
    if tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"a vocabulary-parallel head is Shard(0) on a 1-D mesh, not {weight.placements}")
    mesh = weight.device_mesh
    if isinstance(hidden, DTensor):  # sequence parallel: gather the sequence, as ColwiseParallel's input
        hidden = hidden.redistribute(mesh, [Replicate()]).to_local()
    rows = -(-weight.shape[0] // mesh.size())  # torch.chunk's split, as DTensor's Shard(0)
    return hidden, weight.to_local(), mesh.get_local_rank() * rows, mesh.get_group()


def _vp_chunks(
    hidden: Tensor, w_local: Tensor, targets: Tensor, chunk: int, start: int, group, want_h: bool, want_w: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The chunked loss over this rank's rows of the head: per chunk, the max, the sum of exponentials and
    the target's logit are all-reduced over the mesh, so nothing of size V per token is made or saved.
    d(hidden) is summed over the ranks once, at the end."""
    n, rows = hidden.shape[0], w_local.shape[0]
    dtype = compute_dtype(hidden, w_local)  # as the one-rank form: matmuls in autocast's dtype, fp32 softmax
    grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
    grad_w = torch.zeros(w_local.shape, dtype=torch.float32, device=w_local.device) if want_w else None
    with torch.autocast(hidden.device.type, enabled=False):
        w = w_local.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            h, t = hidden[s : s + chunk].to(dtype), targets[s : s + chunk]
            logits = (h @ w.t()).float()  # (c, V/tp): this rank's vocabulary rows
            mine = (t >= start) & (t < start + rows)
            idx = (t - start).clamp(0, rows - 1)
            target_logit = logits.gather(1, idx[:, None]).squeeze(1) * mine
            dist.all_reduce(target_logit, group=group)
            mx = logits.amax(dim=-1)
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
            probs = logits.sub_(mx[:, None]).exp_()  # in place, as the one-rank form
            sumexp = probs.sum(dim=-1)
            dist.all_reduce(sumexp, group=group)
            total += (mx + sumexp.log() - target_logit).sum()
            if want_h or want_w:
                grad = probs.div_(sumexp[:, None])  # this rank's columns of softmax
                hit = mine.nonzero().squeeze(1)
                grad[hit, idx[hit]] -= 1.0
                grad = grad.div_(n).to(dtype)
                _backprop_chunk(grad_h, grad_w, grad, h, w, s)  # d(hidden): this rank's part of the sum
                del grad
            del logits, probs
        if want_h:
            dist.all_reduce(grad_h, group=group)  # the whole vocabulary's sum, the same on every rank
    return total / n, grad_h.to(hidden.dtype) if want_h else None, grad_w
