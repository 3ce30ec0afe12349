"""Expert parallelism, applied to a model from outside: each MoE layer's `experts` is swapped for an
`ExpertParallel` module that holds 1/ep of them and moves token rows to their experts' ranks.

Routing, capacity dropping and the aux losses stay in the model's `MoE.forward`, on this rank's own
tokens, exactly as on one device; only the expert computation moves (torchtitan's token dispatcher):

    dispatch: all-to-all the rows `moe.dispatch` grouped by expert to the ep rank owning each expert
    compute:  each rank runs its local experts on the rows it received (grouped by expert)
    combine:  all-to-all the outputs back, in the order they came; `moe.combine` sums them per token

Both all-to-alls are autograd-aware (`all_to_all_single_autograd`): backward sends the gradients the
reverse way. Expert weights are DTensors sharded on dim 0 (the expert dim) over the ep mesh, so a
checkpoint holds whole experts under their usual FQNs and reloads at another ep or dp. They are kept
out of FSDP: their gradients already sum the tokens of the ep group; `sync_expert_grads` adds the
`edp` replicas holding the same experts and divides by the data-parallel size, so that every expert
gets the gradient of the mean loss over all data-parallel ranks, as dense weights do.

With tensor parallelism the experts are also split by hidden unit over tp (see `parallelize.py` for why
the experts' projections and not the tokens): the weights are then DTensors over ("ep", "tp") or ("tp",)
alone; split over tp alone they are not kept out of FSDP (it makes them 2-D: dp x tp, as dense weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainers.models.moe import GroupedExperts, moe_layers, run_experts
from trainers.torch_compat import all_to_all_single_autograd

__all__ = ["ExpertParallel", "apply_expert_parallel", "expert_params", "sync_expert_grads"]


class ExpertParallel(nn.Module):
    """Drop-in for `GroupedExperts` (same call, same parameter names): this rank's slice of the experts,
    split by expert over "ep" (fed by all-to-all from the ranks of its ep group) and/or by hidden unit
    over "tp" (w1/w3 by rows, w2 by columns, Megatron's column/row split of each expert's SwiGLU: every tp
    rank gets the same rows and returns partial sums, all-reduced over tp)."""

    def __init__(self, experts: GroupedExperts, mesh: DeviceMesh):
        super().__init__()
        names = mesh.mesh_dim_names
        self.ep_group = mesh.get_group("ep") if "ep" in names else None
        self.tp_group = mesh.get_group("tp") if "tp" in names else None
        self.ep = mesh.size(names.index("ep")) if "ep" in names else 1
        self.num_experts = experts.w1.shape[0]
        self.impl, self.dropless = experts.impl, experts.dropless
        for name, hidden_dim in (("w1", 1), ("w2", 2), ("w3", 1)):
            # Every rank built the same full weights (same seed, or the same meta shapes): keep our slice,
            # no communication.
            local, placements = getattr(experts, name).detach(), []
            for dim_name in names:
                split = 0 if dim_name == "ep" else hidden_dim
                local = local.chunk(mesh.size(names.index(dim_name)), split)[mesh.get_local_rank(dim_name)]
                placements.append(Shard(split))
            self.register_parameter(name, nn.Parameter(DTensor.from_local(local.clone(), mesh, placements)))

    @property
    def sharded_by_expert(self) -> bool:
        return self.ep > 1

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """x: (T*k, dim) rows sorted by expert (all E of them) as `moe.dispatch` returns them, the rows
        dropped over capacity last (they stay here: their output is zero)."""
        if self.ep == 1:
            return self._experts(x, tokens_per_expert, self.dropless)
        local = self.num_experts // self.ep
        send_counts = tokens_per_expert.to(torch.long)
        recv_counts = torch.empty_like(send_counts)  # [source rank, local expert] rows coming to us
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        recv_counts = recv_counts.view(self.ep, local)
        # the all-to-all's split sizes live on the host: expert parallelism syncs here (torchtitan too)
        send_splits = send_counts.view(self.ep, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        kept = sum(send_splits)
        received = all_to_all_single_autograd(x[:kept], recv_splits, send_splits, self.ep_group)
        order = _expert_major(recv_counts)
        out = self._experts(received[order], recv_counts.sum(0), dropless=True)  # only kept rows travel
        out = out[torch.argsort(order)]  # back to source-major order
        out = all_to_all_single_autograd(out, send_splits, recv_splits, self.ep_group)
        return out if kept == len(x) else torch.cat([out, out.new_zeros(len(x) - kept, out.shape[-1])])

    def _experts(self, x: Tensor, tokens_per_expert: Tensor, dropless: bool) -> Tensor:
        """The same expert math as one process; over tp, on this rank's hidden units, then summed."""
        w1, w2, w3 = (getattr(self, n).to_local().to(x.dtype) for n in ("w1", "w2", "w3"))
        if self.tp_group is None:
            return run_experts(self.impl, w1, w2, w3, x, tokens_per_expert, dropless)
        out = run_experts(self.impl, w1, w2, w3, _CopyToTP.apply(x, self.tp_group), tokens_per_expert, dropless)
        return _ReduceFromTP.apply(out, self.tp_group)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the input's gradient over tp (each rank's part of it
    comes through its own hidden units)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: forward sums the partial outputs over tp; backward is the identity (what follows is
    the same on every tp rank)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _expert_major(counts: Tensor) -> Tensor:
    """Row order that regroups rows laid out [source][expert] (block sizes `counts` (S, E)) as
    [expert][source], so each local expert's rows are contiguous."""
    flat = counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(counts)
    sizes, block_starts = counts.t().flatten(), starts.t().flatten()
    offsets = torch.arange(int(sizes.sum()), device=counts.device)
    offsets = offsets - torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes)
    return torch.repeat_interleave(block_starts, sizes) + offsets


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> int:
    """Split every MoE layer's experts over `mesh` (dims "ep" and/or "tp"); returns the layers changed."""
    layers = moe_layers(model)
    for moe in layers:
        moe.experts = ExpertParallel(moe.experts, mesh)
    return len(layers)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights split by expert (ep > 1): FSDP leaves them alone (`sync_expert_grads` syncs
    them). Experts split over tp alone are sharded by FSDP over dp like any tp weight."""
    modules = [m for m in model.modules() if isinstance(m, ExpertParallel) and m.sharded_by_expert]
    return [p for m in modules for p in m.parameters()]


@torch.no_grad()
def sync_expert_grads(model: nn.Module, edp_group: dist.ProcessGroup | None, dp: int) -> None:
    """Sum expert gradients over the ranks holding the same experts (`edp_group`; None when there is one
    such rank), then divide by the data-parallel size: the mean-loss gradient, as FSDP gives dense ones."""
    grads = [p.grad.to_local() for p in expert_params(model) if p.grad is not None]
    if edp_group is not None:
        for g in grads:
            dist.all_reduce(g, op=dist.ReduceOp.SUM, group=edp_group)
    for g in grads:
        g.div_(dp)
