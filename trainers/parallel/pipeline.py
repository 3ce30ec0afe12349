"""Pipeline parallelism with `torch.distributed.pipelining`, composed with FSDP2 and expert parallelism
the way torchtitan composes them (`distributed/pipeline_parallel.py`):

1. split: the blocks are cut into pp x virtual_stages contiguous stages balanced by a cost estimate
   (forward FLOPs per token of each block, so MoE blocks weigh what their top-k experts cost;
   `trainers.layout.split_stages`, which the planner uses too); stage 0 also holds the embedding, the
   last stage the final norm and the head;
2. this rank keeps the blocks of its stages (looped, or V-shaped for ZBV) and drops the others; each
   stage is a `Transformer` shell over the kept modules (the model file's own stage form);
3. the same parallelize steps as without a pipeline run on the kept part: experts sharded over ep, then
   FSDP2 per block and per stage root over this stage's dp ranks; the optimizer over all of it;
4. a schedule (GPipe, 1F1B, Interleaved 1F1B, Interleaved zero-bubble, ZBV zero-bubble) runs each
   step's microbatches; the last stage's loss (`lm_loss` over its logits, or the model's own chunked loss
   inside the stage) goes to every rank of the pipeline.

The kept part keeps the whole model's parameter names (`layers.N...`), so checkpoints are the same
DCP folders as without a pipeline and load at another dp, pp or ep (DCP reshards by name).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Shard

from trainers._base import ConfigError
from trainers.checkpoint import ModelOptimizerState
from trainers.checkpoint_files import OPTIM_KEY, STATE_KEY
from trainers.config import ModelConfig, OptimizerConfig, RunConfig
from trainers.layout import SPLIT_BACKWARD_SCHEDULES, ParallelLayout, block_costs, split_stages
from trainers.loss import lm_loss
from trainers.models import Transformer, build_model
from trainers.models.moe import reset_moe_stats, set_aux_grad_scale
from trainers.optim import build_optimizer
from trainers.parallel.engine import Batch, plain
from trainers.parallel.native import FSDPEngine, ShardedPrecision, fsdp_options, on_meta
from trainers.parallel.parallelize import parallelize

__all__ = ["PipelineEngine", "PartitionedState", "block_costs", "split_stages"]

PIPELINE_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
_SINGLE_STAGE = ("gpipe", "1f1b")


def _stage_module(part: Transformer, layer_ids: list[int], first: bool, last: bool) -> Transformer:
    """A `Transformer` over modules of `part` (shared, not copied): blocks `layer_ids`, the embedding
    when `first`, the final norm and head when `last` (see Transformer's docstring on stages)."""
    with torch.device("meta"):
        stage = Transformer(part.cfg, loss_chunk=part.loss_chunk)
    stage.layers = nn.ModuleDict({str(i): part.layers[str(i)] for i in layer_ids})
    stage.embed_tokens = part.embed_tokens if first else None
    stage.norm = part.norm if last else None
    stage.lm_head = part.lm_head if last else None
    stage.rope_cos, stage.rope_sin = part.rope_cos, part.rope_sin
    return stage


def _keep_only(model: Transformer, layer_ids: set[int], first: bool, last: bool) -> None:
    """Drop what this rank's stages do not hold: it keeps the whole model's FQNs for what remains."""
    for name in [n for n in model.layers if int(n) not in layer_ids]:
        del model.layers[name]
    if not first:
        model.embed_tokens = None
    if not last:
        model.norm, model.lm_head = None, None


# ------------------------------------------------------------------------------------------ the engine


class PipelineEngine(FSDPEngine):
    """FSDP2 over each pipeline stage's dp ranks, a `torch.distributed.pipelining` schedule across the
    stages. `model` is this rank's part of the whole model (its stages' modules, whole-model FQNs)."""

    name = "fsdp"

    def __init__(self, layout: ParallelLayout, device: torch.device):
        super().__init__(layout, device)
        self.pp_group = layout.pp_group()

    def setup(self, model: nn.Module, cfg: RunConfig) -> None:
        lay = self.layout
        self.model_cfg, self.optimizer_cfg = cfg.model, cfg.optimizer
        self.offload = cfg.parallel.offload == "all"
        self.v_shape, self.num_stages = lay.v_shape, lay.num_stages
        # A chunked loss needs the head's weight inside the last stage's forward (FSDP gathers it there):
        # every stage gets the targets, and the last one returns its micro-batch's loss, not logits.
        self.loss_in_stage = cfg.memory.loss_chunk > 0
        self.split = split_stages(block_costs(cfg.model, cfg.data.seq_len), self.num_stages)
        self.stage_ids = lay.stage_ids()
        first, last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        _keep_only(model, {i for s in self.stage_ids for i in self.split[s]}, first, last)
        self.has_first, self.has_last = first, last

        self.precision = ShardedPrecision(cfg.precision, self.device, self.dp_group, self.pp_group)
        options = fsdp_options(cfg, self.mesh, self.precision.mp_policy())
        if cfg.parallel.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES:
            # Their backward runs in two passes (input, then weight gradients) over the autograd graph of
            # the gathered parameters: resharding after forward would take them out of it (ZeRO-2 here).
            options["reshard_after_forward"] = False
        model = model if self.offload or on_meta(model) else model.to(self.device)
        parts = [
            _stage_module(model, self.split[s], s == 0, s == self.num_stages - 1) for s in self.stage_ids
        ]
        for part in parts:  # each stage: TP -> activation checkpointing -> EP -> FSDP (blocks, stage root)
            parallelize(part, lay, cfg, fsdp=options)
            model.layers.update(part.layers)  # the rank's model holds what its stages hold (AC's wrappers)
        self.model, self.parts = model, parts
        self.optimizer = build_optimizer(model, cfg.optimizer)
        self.n_microbatches, self.microbatch_size = lay.microbatches, lay.microbatch_size
        self.stages = [self._stage(part, s, cfg) for part, s in zip(parts, self.stage_ids)]
        self.pipeline_schedule = self._build_pipeline_schedule(cfg.parallel.pipeline_schedule)

    def fsdp_roots(self) -> list[nn.Module]:
        return self.parts  # the stage roots: together they hold every module this rank keeps

    def _stage(self, part: nn.Module, index: int, cfg: RunConfig) -> PipelineStage:
        """A stage with its input and output shapes given, so no shape-inference pass runs (static mode):
        such a pass would route dummy tokens through the experts and count them in the MoE statistics."""
        b, s, m = self.microbatch_size, cfg.data.seq_len, cfg.model
        act = torch.bfloat16 if cfg.precision.dtype == "bf16" else torch.float32  # FSDP's param dtype

        def meta(*shape: int, dtype: torch.dtype = act) -> torch.Tensor:  # activations carry gradients
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

        # With tensor parallelism stages exchange this rank's sequence shard; the last one returns its
        # vocabulary shard of the logits (as torch.chunk splits them, like DTensor's Shard).
        hidden = meta(b, s // self.layout.tp, m.dim)
        vocab = len(torch.empty(m.vocab_size, device="meta").chunk(self.layout.tp)[self.layout.tp_rank])
        inputs = meta(b, s, dtype=torch.long) if index == 0 else hidden
        if index < self.num_stages - 1:
            outputs = hidden
        elif self.loss_in_stage:
            outputs = meta(dtype=torch.float32)  # the micro-batch's mean loss
        else:
            outputs = meta(b, s, vocab)
        return PipelineStage(
            part,
            index,
            self.num_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.pp_group,
        )

    def _build_pipeline_schedule(self, name: str) -> Any:
        cls = PIPELINE_SCHEDULES[name]
        stages = self.stages[0] if name in _SINGLE_STAGE else self.stages
        try:
            return cls(stages, n_microbatches=self.n_microbatches, loss_fn=self._loss)
        except ValueError as e:
            raise ConfigError(
                f"parallel.pipeline_schedule={name} with {self.n_microbatches} microbatches on pp="
                f"{self.layout.pp}: {e}; fix: change parallel.n_microbatches (or train.micro_batch_size)"
            ) from None

    # ------------------------------------------------------------------------------------------ step

    def forward_backward(self, batches: Iterable[Batch], count: int) -> torch.Tensor:
        """The whole step's batch through the schedule, split into `n_microbatches`; returns the mean
        loss, from the last stage, on every rank of the pipeline."""
        reset_moe_stats(self.model)
        # The schedule divides every gradient by n_microbatches after the last backward: the aux losses'
        # gradient must not be divided before (each microbatch's task loss is not either).
        set_aux_grad_scale(self.model, self.loss_scale, self.device)
        inputs, targets = (torch.cat(t) for t in zip(*batches))
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = targets if self.has_last else None
        kwargs = {"targets": targets} if self.loss_in_stage else {}  # split into micro-batches as inputs are
        with self.loss_context():  # the schedule runs each loss's backward inside it
            self.pipeline_schedule.step(
                *args,
                target=target,
                losses=losses if self.has_last else None,
                return_outputs=False,
                **kwargs,
            )
        self.finish_grads()
        if self.has_last:
            loss = torch.stack([plain(x.detach()) for x in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        return self._from_last_stage(loss.float())

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_in_stage:  # the last stage returned its loss already
            return output
        return lm_loss(self._logits(output), target)

    def _logits(self, output: torch.Tensor) -> torch.Tensor:
        """The last stage's output as the loss takes it: with tensor parallelism, this rank's vocabulary
        shard of the logits becomes the vocabulary-sharded DTensor that `loss_parallel` expects."""
        if self.layout.tp == 1:
            return output
        return DTensor.from_local(output, self.layout.tp_mesh(), [Shard(2)], run_check=False)

    def _from_last_stage(self, value: torch.Tensor) -> torch.Tensor:
        """Every rank of the pipeline gets the last stage's value (zero elsewhere, then summed)."""
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.pp_group)
        return value

    @torch.no_grad()
    def eval_loss(self, batches: Iterable[Batch]) -> torch.Tensor:
        """Forward only, stage by stage, without a schedule (validation batches may differ in size from
        the training microbatches the schedule's buffers are sized for). Activations travel in fp32."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for inputs, targets in batches:
            h = inputs
            for s in range(self.num_stages):
                owner = self.layout.stage_owner(s, self.v_shape)
                if owner != self.layout.pp_rank:
                    continue
                if s > 0 and self.layout.stage_owner(s - 1, self.v_shape) != owner:
                    batch, seq = inputs.shape  # this rank's sequence shard with tensor parallelism
                    h = torch.empty(batch, seq // self.layout.tp, self.model_cfg.dim, device=self.device)
                    dist.recv(h, group=self.pp_group, group_src=self.layout.stage_owner(s - 1, self.v_shape))
                # the targets as the schedule passes them (a keyword: TP's input plan takes the positional h)
                kwargs = {"targets": targets} if s == self.num_stages - 1 and self.loss_in_stage else {}
                with self.autocast():
                    h = self.parts[self.stage_ids.index(s)](h, **kwargs)
                if s < self.num_stages - 1 and self.layout.stage_owner(s + 1, self.v_shape) != owner:
                    dist.send(
                        h.float(), group=self.pp_group, group_dst=self.layout.stage_owner(s + 1, self.v_shape)
                    )
            if self.has_last:
                with self.loss_context():
                    loss = h if self.loss_in_stage else lm_loss(self._logits(h), targets)
                    total += plain(loss) * len(inputs)
        self.model.train()
        return self._from_last_stage(total)

    # ------------------------------------------------------------------------------------ checkpoint

    def checkpoint_state(self, with_optimizer: bool = True) -> dict[str, Any]:
        return {STATE_KEY: PartitionedState(self.model, self.optimizer, with_optimizer, self.optimizer_cfg)}


class PartitionedState(ModelOptimizerState):
    """One rank's part of the model and optimizer under the whole model's FQNs. Tensors are saved by
    name, each by the rank holding it; the optimizer's param_groups (a list, one object in the
    checkpoint) are written as a single process writes them: the whole model's parameter names with this
    run's hyperparameters, the same on every rank. So the folder is the one a single process or a
    pipeline of any depth saves, and loads into either (only this rank's names are applied on load)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool, cfg: OptimizerConfig
    ):
        super().__init__(model, optimizer, with_optimizer)
        self.cfg = cfg
        self.local_groups: list[dict] = []

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if OPTIM_KEY in state:
            self.local_groups = state[OPTIM_KEY]["param_groups"]
            whole = _whole_model_groups(self.model.cfg, self.cfg)
            state[OPTIM_KEY]["param_groups"] = [
                {**group, "params": whole[group["decay"]]} for group in self.local_groups
            ]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if OPTIM_KEY in state:
            local = {g["decay"]: g["params"] for g in self.local_groups}
            state[OPTIM_KEY]["param_groups"] = [
                {**g, "params": local[g["decay"]]}
                for g in state[OPTIM_KEY]["param_groups"]
                if g["decay"] in local
            ]
        super().load_state_dict(state)


def _whole_model_groups(model_cfg: ModelConfig, cfg: OptimizerConfig) -> dict[bool, list[str]]:
    """Parameter names of each optimizer group (by its `decay` flag) of the whole model, in the order a
    single process's optimizer holds them (a meta-device build: no memory, no init)."""
    model = build_model(model_cfg, device="meta")
    names = {id(p): name for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, cfg)
    return {g["decay"]: [names[id(p)] for p in g["params"]] for g in optimizer.param_groups}
