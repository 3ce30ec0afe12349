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
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainers.models.moe import GroupedExperts, moe_layers

__all__ = ["ExpertParallel", "apply_expert_parallel", "expert_params", "sync_expert_grads"]


class ExpertParallel(nn.Module):
    """Drop-in for `GroupedExperts` (same call, same parameter names): this rank's slice of the experts,
    fed by all-to-all from the ranks of its ep group."""

    def __init__(self, experts: GroupedExperts, mesh: DeviceMesh):
        super().__init__()
        self.group = mesh.get_group()
        self.ep, rank = mesh.size(), mesh.get_local_rank()
        self.num_experts = experts.w1.shape[0]
        for name in ("w1", "w2", "w3"):
            # Every rank built the same full weights (same seed): keep our slice, no communication.
            local = getattr(experts, name).detach().chunk(self.ep)[rank].clone()
            self.register_parameter(name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)])))

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """x: (N, dim) rows grouped by expert (all E of them) as `moe.dispatch` returns them."""
        local = self.num_experts // self.ep
        send_counts = tokens_per_expert.to(torch.long)
        recv_counts = torch.empty_like(send_counts)  # [source rank, local expert] rows coming to us
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        recv_counts = recv_counts.view(self.ep, local)
        send_splits = send_counts.view(self.ep, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        order = _expert_major(recv_counts)
        weights = SimpleNamespace(**{n: getattr(self, n).to_local().to(x.dtype) for n in ("w1", "w2", "w3")})
        out = GroupedExperts.forward(weights, received[order], recv_counts.sum(0))  # the same expert math
        out = out[torch.argsort(order)]  # back to source-major order
        return all_to_all_single_autograd(out, send_splits, recv_splits, self.group)


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
    """Shard every MoE layer's experts over the 1-D ep `mesh`; returns the number of layers changed."""
    layers = moe_layers(model)
    for moe in layers:
        moe.experts = ExpertParallel(moe.experts, mesh)
    return len(layers)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, ExpertParallel) for p in m.parameters()]


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
