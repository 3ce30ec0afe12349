"""torch's own data-parallel engines over the layout's `dp` mesh: DDP (replicated) and FSDP2 (sharded).

FSDP2 is the last step of `trainers.parallel.parallelize` (TP -> activation checkpointing -> EP -> FSDP, as in
torchtitan's `parallelize.py`): its `apply_fsdp` (importable from here too) shards each block, then the
root, with the options this module makes (`fsdp_options`); the optimizer is built last, over the sharded
(DTensor) parameters, so its state is sharded too.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainers._base import ConfigError
from trainers.config import ModelConfig, PrecisionConfig, RunConfig
from trainers.layout import ParallelLayout
from trainers.models import Transformer
from trainers.models.moe import moe_totals, stats_from_totals
from trainers.optim import build_optimizer
from trainers.parallel.engine import Engine
from trainers.parallel.expert import sync_expert_grads
from trainers.parallel.parallelize import apply_fsdp, parallelize
from trainers.precision import Precision
from trainers.torch_compat import flatten_mesh

__all__ = ["DDPEngine", "FSDPEngine", "ShardedPrecision", "apply_fsdp", "on_meta"]


class _DataParallelEngine(Engine):
    """Ranks, mesh and the mean over data-parallel ranks, shared by DDP and FSDP."""

    def __init__(self, layout: ParallelLayout, device: torch.device):
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"parallel.engine={self.name} needs a process group; fix: launch with `torchrun "
                f"--nproc-per-node N -m trainers train RUN.yaml` (N=1 for one device), or Ray, or set parallel.engine=none"
            )
        super().__init__(device, layout)
        self.dp_rank, self.dp_size, self.world_size = layout.dp_rank, layout.dp, layout.world_size
        self.mesh = layout.dp_mesh()
        self.dp_group = self.mesh.get_group()
        self.model_cfg: ModelConfig | None = None

    @property
    def is_main(self) -> bool:
        return self.layout.rank == 0  # with pipeline stages, every stage has a dp rank 0

    def setup(self, model: nn.Module, cfg: RunConfig) -> None:
        self.model_cfg = cfg.model
        super().setup(model, cfg)

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        # SUM then divide: gloo has no AVG. A copy: the caller's tensor stays this rank's value. Over the
        # layout's dp ranks (a replica group's workers, where `dp_size` counts every live group's).
        total = value.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
        return total / self.layout.dp

    def moe_stats(self) -> dict[str, Any]:
        """Router statistics summed over every rank: data-parallel ranks route their own tokens, and with
        pipeline stages each layer lives on one stage. One all-reduce over all ranks of a zero-padded
        (layers, 2E + 3) table does both."""
        moe = self.model_cfg.moe if self.model_cfg is not None else None
        if moe is None:
            return {}
        table = torch.zeros(self.model_cfg.n_layers, 2 * moe.num_experts + 3, device=self.device)
        for layer, totals in moe_totals(self.model).items():
            table[layer] = totals / self.layout.tp  # the tp ranks of a group route the same tokens
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        rows = [i for i in range(self.model_cfg.n_layers) if self.model_cfg.is_moe_layer(i)]
        return stats_from_totals(table[rows])


class DDPEngine(_DataParallelEngine):
    """Whole model on every rank; gradients averaged by all-reduce on the last micro-batch.

    Checkpoints: `get_state_dict` strips DDP's `module.` prefix, and DCP's save planner de-duplicates
    replicated tensors, so each tensor is written once across ranks, not once per rank."""

    name = "ddp"

    def wrap(self, model: nn.Module, cfg: RunConfig) -> nn.Module:
        model = super().wrap(model, cfg)
        device_ids = [self.device.index] if self.device.type == "cuda" else None  # CPU: no device_ids
        return DistributedDataParallel(model, device_ids=device_ids, process_group=self.dp_group)

    def no_sync(self, final_micro_batch: bool) -> contextlib.AbstractContextManager:
        # Earlier micro-batches accumulate locally; the final backward all-reduces the sum once.
        return contextlib.nullcontext() if final_micro_batch else self.model.no_sync()


class FSDPEngine(_DataParallelEngine):
    """FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded over `dp`.

    zero_stage 3 reshards parameters after forward (all-gathered again in backward); 2 keeps them
    gathered from forward to backward. Precision: see `ShardedPrecision`."""

    name = "fsdp"

    def setup(self, model: nn.Module, cfg: RunConfig) -> None:
        self.model_cfg = cfg.model
        self.offload = cfg.parallel.offload == "all"
        self.sharded_accumulation = cfg.parallel.sharded_accumulation
        self.precision = ShardedPrecision(cfg.precision, self.device, self.dp_group, self.layout.pp_group())
        self.fsdp_options = fsdp_options(cfg, self.mesh, self.precision.mp_policy())
        self.model = self.wrap(model, cfg)
        # After sharding: the optimizer must hold the DTensor shards, not the full tensors.
        self.optimizer = build_optimizer(self.model, cfg.optimizer)

    def wrap(self, model: nn.Module, cfg: RunConfig) -> nn.Module:
        # With CPU offload the shards live on the CPU: leave the model there (FSDP2 moves it). A meta-device
        # model (model.init_from) is sharded as it is; `materialize` then allocates the shards.
        model = model if self.offload or on_meta(model) else model.to(self.device)
        return parallelize(model, self.layout, cfg, fsdp=self.fsdp_options)

    shards_meta_models = True

    def materialize(self) -> None:
        """After `setup` of a meta-device model: allocate this rank's shards, uninitialised (the caller
        loads them), through the FSDP roots so that FSDP2 re-registers its sharded parameters."""
        from trainers.hf.pretrained import materialize

        materialize(self.fsdp_roots(), torch.device("cpu") if self.offload else self.device)
        if isinstance(self.model, Transformer):
            self.model.init_rope(self.device)

    def fsdp_roots(self) -> list[nn.Module]:
        return [self.model]

    def backward(self, loss: torch.Tensor, final_micro_batch: bool) -> None:
        super().backward(loss, final_micro_batch)
        if final_micro_batch:
            self.finish_grads()

    def finish_grads(self) -> None:
        """After the step's last backward: FSDP has averaged dense gradients over dp; experts' next."""
        if self.layout.ep > 1:
            sync_expert_grads(self.model, self.layout.edp_group(), self.dp_size)

    @contextlib.contextmanager
    def no_sync(self, final_micro_batch: bool) -> Iterator[None]:
        # parallel.grad_accumulation: sharded = reduce-scatter every micro-batch and accumulate into the
        # shards (FSDP2's default); unsharded = skip it on earlier micro-batches, FSDP2 then accumulates
        # whole fp32 gradients (one full set of memory) and reduces once, on the final one.
        self.model.set_requires_gradient_sync(final_micro_batch or self.sharded_accumulation)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def fsdp_options(cfg: RunConfig, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> dict:
    """`fully_shard` keyword arguments for a run."""
    # Pinned host memory speeds copies to a GPU; without one, pinning is an error.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    return dict(
        mesh=mesh,
        reshard_after_forward=cfg.parallel.stage == 3,
        mp_policy=mp_policy,
        offload_policy=offload if cfg.parallel.offload == "all" else OffloadPolicy(),
    )


class ShardedPrecision(Precision):
    """Precision under FSDP2, and the GLOBAL grad norm over DTensor shards.

    bf16: FSDP all-gathers the weights in bf16 and the whole forward/backward runs in bf16; gradients are
    reduced and kept in fp32, on fp32 master shards. No autocast then: the matmuls already see bf16
    weights (it would only add per-op casts), as torchtitan runs FSDP. Unlike single-process autocast,
    the residual stream and norms run in bf16 too; the equivalence tests bound the difference.
    fp16: autocast over fp32 shards, as on one process: fp16's range (max 65504) can overflow
    activations that autocast keeps in fp32 (the residual stream), and the loss scaler only rescues
    gradients. The price is fp32 all-gathers. Its scaler all-reduces found-inf: each rank sees a shard."""

    def __init__(
        self,
        cfg: PrecisionConfig,
        device: torch.device,
        group: dist.ProcessGroup,
        pp_group: dist.ProcessGroup | None = None,
    ):
        super().__init__(cfg, device)
        self.pp_group = pp_group  # pipeline stages hold different parameters: norms add up over it
        self.param_dtype = torch.bfloat16 if cfg.dtype == "bf16" else None
        if self.scaler is not None:
            self.scaler = ShardedGradScaler(
                device.type,
                init_scale=cfg.init_scale,
                growth_interval=cfg.growth_interval,
                process_group=group,
            )

    def mp_policy(self) -> MixedPrecisionPolicy:
        reduce_dtype = torch.float32 if self.param_dtype is not None else None
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=reduce_dtype)

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.param_dtype is not None else super().autocast()

    def clip(
        self, opt: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float | None
    ) -> float:
        if self.scaler is not None:
            with warnings.catch_warnings():
                # torch's own shape-(1,) scale and found-inf tensors meet DTensor grads inside unscale_;
                # DTensor warns that it replicates them, which is what is meant.
                warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
                self.scaler.unscale_(opt)
        groups = _by_mesh([p for p in params if p.grad is not None])
        norms = [_norm([p.grad for p in group]) for group in groups]
        norm = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
        if self.pp_group is not None:
            square = norm.square()
            dist.all_reduce(square, op=dist.ReduceOp.SUM, group=self.pp_group)
            norm = square.sqrt()
        if max_norm is not None:
            for group in groups:  # one mesh per call: foreach kernels do not mix DTensor meshes
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return float(norm)


def _by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters grouped by DTensor mesh (dense shards on dp, expert shards on ep), in first-seen order."""
    groups: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values()) or [[]]


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of whole gradients from this rank's shards (all on one mesh, see `_by_mesh`)."""
    mesh = grads[0].device_mesh if grads and isinstance(grads[0], DTensor) else None
    if mesh is None or mesh.ndim == 1:
        norm = torch.nn.utils.get_total_norm(grads)
        # The norm of local shards is a Partial DTensor: full_tensor() all-reduces it into the norm a
        # single process computes over the whole gradients (torchtitan's dist_utils.clip_grad_norm_).
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    # dp x tp: one all-reduce of the local squares over the mesh's ranks (DTensor would run one per mesh
    # dimension, and one per mix of placements), each shard counted once: a shard replicated over a mesh
    # dimension is on mesh.size(dim) ranks.
    square = torch.zeros((), device=grads[0].to_local().device)
    for g in grads:
        replicas = math.prod(mesh.size(i) for i, p in enumerate(g.placements) if p.is_replicate())
        square += g.to_local().float().square().sum() / replicas
    dist.all_reduce(square, group=flatten_mesh(mesh).get_group())
    return square.sqrt()
