"""The Mixtral-form mixture-of-experts feed-forward: a softmax router picks top-k SwiGLU experts per token.

`dispatch` sorts token-assignments by expert and `combine` sums them back per token; expert parallelism
(trainers/parallel/expert.py) moves only the expert computation between them. Every shape there is static
(overflow moves behind the kept rows), so with grouped matmuls (torchtitan's MoE) a block runs without a
host sync and compiles without a graph break. The aux losses reach the gradient through `_AuxLossScaler`
(Megatron-LM's MoEAuxLossAutoScaler), so forward stays tensor-in/tensor-out for pipeline stages.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainers.sections.model import ModelConfig
from trainers.torch_compat import current_graph_task_id, grouped_mm

__all__ = [
    "GroupedExperts",
    "MoE",
    "Routing",
    "combine",
    "dispatch",
    "grouped_mm_native",
    "moe_layers",
    "moe_stats",
    "moe_totals",
    "reset_moe_stats",
    "run_experts",
    "set_aux_grad_scale",
    "stats_from_totals",
]

_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


class Routing(NamedTuple):
    """Where each token-assignment went. The rows `dispatch` returns are sorted by expert: the kept ones
    first (grouped by expert), then those over capacity (their output is zero). Assignments are numbered
    choice-major: assignment j*T + i is token i's j-th choice."""

    token_ids: Tensor  # (T*k,) source token of each sorted row
    weights: Tensor  # (T*k,) router weight of each assignment, choice-major
    tokens_per_expert: Tensor  # (E,) long, kept assignments per expert
    order: Tensor  # (T*k,) the assignment each sorted row holds
    rows: Tensor  # (T*k,) the sorted row each assignment went to (order's inverse)


def _count(ids: Tensor, num_experts: int) -> Tensor:
    """bincount without its host sync (CUDA's bincount reads the largest id to size its output)."""
    return torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


class _Gather(torch.autograd.Function):
    """`x[index]` whose backward gathers too: `index` picks each of x's rows `k` times (the k choices of each
    token), `back` is the output row each (row, choice) went to, choice-major; `k` = 1: a permutation and its
    inverse. Indexing's own backward is an atomic index_add: 2.3 ms of an H200 bf16 MoE step."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, back: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(back)
        ctx.k = k
        return x[index]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (back,) = ctx.saved_tensors
        rows = grad[back]
        return (rows if ctx.k == 1 else rows.view(ctx.k, -1, rows.shape[-1]).sum(0)), None, None, None


def dispatch(
    x: Tensor, expert_ids: Tensor, weights: Tensor, num_experts: int, capacity: int | None
) -> tuple[Tensor, Routing]:
    """Sort the (T, k) assignments of tokens `x` (T, dim) by expert, keeping at most `capacity` per expert:
    ranked choice-major, then by token, so overflow drops second choices first and later tokens before
    earlier (GShard/Switch). The dropped move behind all kept rows: T*k rows whatever the routing."""
    num_tokens, top_k = expert_ids.shape
    flat_experts = expert_ids.t().reshape(-1)  # choice-major
    flat_tokens = torch.arange(num_tokens, device=x.device).repeat(top_k)
    order = torch.argsort(flat_experts, stable=True)  # stable: keeps the priority order inside each expert
    counts = _count(flat_experts, num_experts)
    if capacity is not None:
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(order.numel(), device=x.device) - starts[flat_experts[order]]
        order = order[torch.argsort(rank >= capacity, stable=True)]
        counts = counts.clamp(max=capacity)
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
    routing = Routing(flat_tokens[order], weights.t().reshape(-1), counts, order, rows)
    return _Gather.apply(x, routing.token_ids, rows, top_k), routing


def combine(expert_out: Tensor, routing: Routing, num_tokens: int) -> Tensor:
    """Sum each token's kept expert outputs, weighted by the router (a fully dropped token gets zeros): a
    gather back to choice-major order, then a sum over each token's k rows, with no atomic adds."""
    k = len(routing.order) // num_tokens
    rows = _Gather.apply(expert_out, routing.rows, routing.order, 1).view(k, num_tokens, -1)
    return (rows * routing.weights.to(expert_out.dtype).view(k, num_tokens, 1)).sum(0)


def grouped_mm_native(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch has a grouped-matmul kernel for `device` and `dtype` that needs no host sync: CUDA's
    (CUTLASS, sm90/sm100, bf16; its fallback elsewhere copies the offsets to the host) and the CPU's (a
    loop over the groups in C++, torch >= 2.9; fp32 in eager only: torch.compile traces bf16 alone)."""
    if grouped_mm is None:
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_properties(device).major in (9, 10)
    if device.type != "cpu" or _TORCH < (2, 9):
        return False
    return dtype == torch.bfloat16 or not torch.compiler.is_compiling()


def _aligned(dtype: torch.dtype, *weights: Tensor) -> bool:
    """Whether grouped_mm's kernels (CPU's and CUDA's: 16-byte TMA loads) take these experts: rows of dim and
    of the hidden size (per tensor-parallel rank) in multiples of 16 bytes, and, in eager, weights that start
    on a 16-byte boundary where no cast copies them (a view into a flat buffer may not)."""
    if any(n * dtype.itemsize % 16 for n in weights[0].shape[-2:]):
        return False
    return torch.compiler.is_compiling() or all(w.dtype != dtype or w.data_ptr() % 16 == 0 for w in weights)


def _loop(w1: Tensor, w2: Tensor, w3: Tensor, x: Tensor, tokens_per_expert: Tensor, dropless: bool) -> Tensor:
    """One matmul per expert, on its rows of x; rows past the last expert's get zeros."""
    counts = tokens_per_expert.tolist()  # a host sync: the split sizes
    kept = sum(counts)
    outs = []
    for e, x_e in enumerate(torch.split(x[:kept], counts)):
        h = F.silu(F.linear(x_e, w1[e])) * F.linear(x_e, w3[e])
        outs.append(F.linear(h, w2[e]))
    out = torch.cat(outs)
    return out if kept == len(x) else torch.cat([out, out.new_zeros(len(x) - kept, out.shape[-1])])


def _grouped(w1: Tensor, w2: Tensor, w3: Tensor, x: Tensor, tokens_per_expert: Tensor, dropless: bool) -> Tensor:
    """Each projection one `torch._grouped_mm` over all experts, groups ending at `offsets` (on the device);
    rows past the last group (none if dropless) are masked: grouped_mm leaves them unwritten on CUDA."""
    offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    device = x.device.type
    # autocast does not cast for grouped_mm: cast as it does for the loop's F.linear
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    if not dropless:
        inside = (torch.arange(len(x), device=x.device) < offsets[-1])[:, None]
        x = torch.where(inside, x, 0)
    h = F.silu(grouped_mm(x, w1.mT, offs=offsets)) * grouped_mm(x, w3.mT, offs=offsets)
    out = grouped_mm(h, w2.mT, offs=offsets)
    return out if dropless else torch.where(inside, out, 0)


def run_experts(impl: str, w1: Tensor, w2: Tensor, w3: Tensor, x: Tensor, tokens_per_expert: Tensor,
                dropless: bool = False) -> Tensor:
    """SwiGLU experts w1/w3 (E, hidden, dim), w2 (E, dim, hidden) on rows x (N, dim) sorted by expert,
    `tokens_per_expert` rows each, any rows after them unused (zeros out); `dropless`: there are none.
    `impl` as `model.moe.impl`."""
    if impl == "auto":
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else w1.dtype
        impl = "grouped" if grouped_mm_native(x.device, dtype) and _aligned(dtype, w1, w2, w3) else "loop"
    return (_grouped if impl == "grouped" else _loop)(w1, w2, w3, x, tokens_per_expert, dropless)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights (dim 0 = expert, the dim expert parallelism shards).
    HF Mixtral names: w1 = gate, w3 = up, w2 = down; export unstacks them."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, impl: str = "auto", dropless: bool = False):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.impl, self.dropless = impl, dropless  # dropless: `dispatch` keeps every row

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """x: (T*k, dim) sorted by expert as `dispatch` returns it; runs each expert on its own rows."""
        return run_experts(self.impl, self.w1, self.w2, self.w3, x, tokens_per_expert, self.dropless)


class _AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; in backward gives `aux_loss` the gradient `scale` (a 0-dim tensor: Megatron-LM's
    MoEAuxLossAutoScaler), as if `scale * aux_loss` had been added to the loss."""

    @staticmethod
    def forward(ctx, output: Tensor, aux_loss: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(aux_loss, scale)
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, None]:
        aux_loss, scale = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * scale, None


class MoE(nn.Module):
    """Router (`gate`) + `experts`, the `block_sparse_moe` of an HF Mixtral layer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.moe
        self.gate = nn.Linear(cfg.dim, cfg.moe.num_experts, bias=False)
        self.experts = GroupedExperts(
            cfg.moe.num_experts, cfg.dim, cfg.hidden_dim, cfg.moe.impl, dropless=cfg.moe.capacity_factor is None
        )
        # Set per micro-step by `set_aux_grad_scale`. A 0-dim tensor changed in place: a compiled block takes
        # it as an input (a float would recompile for each fp16 loss scale). Not a buffer: a module cast to
        # 16 bits (DeepSpeed's) must not round it, nor fp16 overflow it.
        self.aux_grad_scale = torch.ones((), device="cpu")
        self.last_stats: dict[str, Tensor] = {}
        self.totals: Tensor | None = None  # sums since `reset_moe_stats`: see `_record`

    def capacity(self, num_tokens: int) -> int | None:
        if self.cfg.capacity_factor is None:
            return None  # dropless
        return math.ceil(num_tokens * self.cfg.top_k / self.cfg.num_experts * self.cfg.capacity_factor)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Returns router logits and probs (fp32), and the top-k expert ids and their weights."""
        logits = self.gate(x).float()  # softmax in fp32: bf16 router probabilities are too coarse
        probs = logits.softmax(dim=-1)
        weights, expert_ids = probs.topk(self.cfg.top_k, dim=-1)
        if self.cfg.top_k > 1:
            # Mixtral renormalises the top-k weights; for top-1 this would make the weight 1 and cut the
            # router off from the task loss, so top-1 keeps the raw probability (Switch Transformer).
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, expert_ids, weights

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits, probs, expert_ids, weights = self.route(x)
        routed, routing = dispatch(x, expert_ids, weights, self.cfg.num_experts, self.capacity(len(x)))
        out = combine(self.experts(routed, routing.tokens_per_expert), routing, len(x))
        aux_loss = self._aux_losses(logits, probs, expert_ids, routing)
        return _AuxLossScaler.apply(out, aux_loss, self.aux_grad_scale).view(shape)

    def _aux_losses(self, logits: Tensor, probs: Tensor, expert_ids: Tensor, routing: Routing) -> Tensor:
        """Coefficient-weighted Switch load-balancing loss + ST-MoE z-loss; records `last_stats`."""
        num_assignments = expert_ids.numel()
        # f_i counts assignments before dropping (Switch): the router is pushed by what it asked for.
        requested = _count(expert_ids.flatten(), self.cfg.num_experts)
        f = requested.float() / num_assignments
        balance = self.cfg.aux_loss_coef * self.cfg.num_experts * (f * probs.mean(dim=0)).sum()
        z_loss = self.cfg.z_loss_coef * torch.logsumexp(logits, dim=-1).square().mean()
        kept = routing.tokens_per_expert.sum()
        self.last_stats = {
            "aux_loss": balance.detach(),
            "z_loss": z_loss.detach(),
            "tokens_per_expert": routing.tokens_per_expert.detach(),
            "dropped_fraction": (1.0 - kept.float() / num_assignments).detach(),
        }
        self._record(requested, routing.tokens_per_expert, balance, z_loss)
        return balance + z_loss

    @torch.no_grad()
    def _record(self, requested: Tensor, kept: Tensor, balance: Tensor, z_loss: Tensor) -> None:
        """Add this forward to `totals` = [requested (E), kept (E), aux loss, z-loss, forwards], sums that add
        up over micro-batches and ranks. A forward re-run by activation checkpointing inside backward (a graph
        task is running) is not counted; compiled, the recomputation never re-runs this (and asking for the
        graph task id would break the graph)."""
        if not torch.compiler.is_compiling() and current_graph_task_id() != -1:
            return
        one = balance.new_ones(1)
        row = torch.cat([requested.float(), kept.float(), balance.detach()[None], z_loss.detach()[None], one])
        self.totals = row if self.totals is None else self.totals + row


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE modules of `model`, in layer order (found through any wrapper)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_aux_grad_scale(model: nn.Module, scale: float, device: torch.device | None = None) -> None:
    """Before each micro-step's forward: the aux losses' gradient is the task loss's factor (1/accumulation *
    loss scale). `device`: where the blocks compute (default: the router weight's), so a compiled block mixes
    no devices."""
    for m in moe_layers(model):
        where = device or m.gate.weight.device
        if m.aux_grad_scale.device != where:  # moved once, then changed in place
            m.aux_grad_scale = torch.empty((), device=where)
        m.aux_grad_scale.fill_(float(scale))


def reset_moe_stats(model: nn.Module) -> None:
    """Start a new count (the trainer calls it at the start of each step)."""
    for m in moe_layers(model):
        m.totals = None


def moe_totals(model: nn.Module) -> dict[int, Tensor]:
    """Each MoE layer's `totals` since the last reset, keyed by its block index N (FQN `layers.N...`)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m.totals is not None:
            out[int(name.split("layers.", 1)[1].split(".", 1)[0])] = m.totals
    return out


def stats_from_totals(totals: Tensor) -> dict[str, Any]:
    """Router statistics from stacked `totals` rows (layers, 2E + 3), summed over micro-batches and ranks:
    losses are means over forwards summed over layers; loads count token-assignments."""
    if totals.numel() == 0:
        return {}
    num_experts = (totals.shape[-1] - 3) // 2
    requested, kept = totals[:, :num_experts], totals[:, num_experts : 2 * num_experts]
    forwards = totals[:, -1].clamp_min(1)
    imbalance = kept.max(dim=-1).values / kept.mean(dim=-1).clamp_min(1e-9)
    return {
        "moe_aux_loss": float((totals[:, -3] / forwards).sum()),
        "moe_z_loss": float((totals[:, -2] / forwards).sum()),
        "moe_dropped_fraction": float(1.0 - kept.sum() / requested.sum().clamp_min(1)),  # x100: tokens dropped %
        "moe_load_imbalance": float(imbalance.mean()),  # max/mean tokens per expert, averaged over layers
        "moe_load_imbalance_max": float(imbalance.max()),  # the worst layer
        "moe_tokens_per_expert": kept.round().long().tolist(),  # per layer: token-assignments each expert ran
    }


def moe_stats(model: nn.Module) -> dict[str, Any]:
    """Router statistics of the forwards since the last reset, over this process's MoE layers; {} for a
    dense model. Engines that split the model or the batch sum `moe_totals` over ranks first."""
    totals = moe_totals(model)
    return stats_from_totals(torch.stack([totals[i] for i in sorted(totals)])) if totals else {}
