"""One `parallelize(part, layout, cfg)` that applies every kind of parallelism to a model part, in a fixed
order (torchtitan's `parallelize.py` is the model):

1. tensor parallelism (`apply_tensor_parallel`): it names submodules by their model-file names, so it
   runs before anything wraps them;
2. activation checkpointing (`trainers.parallel.ac`): wraps whole blocks, TP's hooks inside;
3. torch.compile per block (`train.compile`): the block's forward, AC's recomputation included, compiled
   in place (`nn.Module.compile`, so parameter names do not change); identical blocks share one graph;
4. expert parallelism (`trainers.parallel.expert`): swaps each MoE layer's experts for this rank's slice
   (split over ep and/or tp) before FSDP, so FSDP leaves ep-sharded experts alone;
5. FSDP2 (`apply_fsdp`, with the options `trainers.parallel.native.fsdp_options` makes): each block, then
   the part's root, over the dp mesh; with tp the parameters are already tp DTensors and FSDP makes them
   2-D (dp x tp).

The single-stage engines call it once on the whole model; the pipeline calls it once per stage, on the
stage's `Transformer` shell. The model files hold no distributed code.

Tensor parallelism (Megatron-LM's column/row splits with sequence parallelism, torch's DTensor styles):
- between blocks the residual stream is a DTensor sharded on the sequence (Shard(1)) over tp, so the
  norms (`SequenceParallel`) and the residual adds run on 1/tp of the tokens, and activations divide by tp;
- attention: the input is all-gathered (Shard(1) -> Replicate), q/k/v are split by heads (column-wise, so
  each rank runs n_heads/tp query heads and n_kv_heads/tp KV heads: GQA's grouping stays rank-local),
  o_proj by rows, its partial sums reduce-scattered back to the sequence shard; the MLP likewise
  (gate/up column-wise, down row-wise);
- the embedding is split by vocabulary rows; the head by vocabulary columns, and its logits stay sharded
  on the vocabulary (Shard(-1)): the loss runs under `loss_parallel`, so no rank holds all logits;
- MoE layers: the experts' projections are split like the MLP (over their hidden units), not the tokens.
  Every tp rank routes the whole (all-gathered) sequence, so routing, capacity dropping and the aux losses
  are exactly those of one process (token-split routing would compute the load-balancing loss and drop
  tokens over 1/tp of the tokens: another model); the experts' partial outputs are all-reduced over tp
  before the routing weights combine them. Expert parallelism, when on, moves tokens over ep as before.
- a pipeline stage that is not the first takes (and one that is not the last returns) plain tensors of
  its sequence shard; hooks on the stage's root wrap and unwrap them.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainers.layout import ParallelLayout
from trainers.models import Transformer
from trainers.parallel.ac import apply_activation_checkpointing
from trainers.parallel.expert import apply_expert_parallel, expert_params
from trainers.torch_compat import skip_side_effects_in_checkpoint_backward

if TYPE_CHECKING:
    from trainers.config import RunConfig

# A pipeline stage under tensor parallelism returns its output as `to_local()` of a DTensor, a view, and
# torch 2.13's FSDP2 warns of any view a wrapped module returns (an in-place op on it would skip FSDP's
# pre-backward hook). The schedule only sends, keeps and differentiates stage outputs, never changes them in
# place: a user could not act on the warning. (A module-level filter: the warning comes from each forward.)
STAGE_OUTPUT_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"
warnings.filterwarnings("ignore", message=STAGE_OUTPUT_VIEW_WARNING)

__all__ = ["apply_fsdp", "apply_tensor_parallel", "compile_blocks", "parallelize"]


def parallelize(part: nn.Module, layout: ParallelLayout, cfg: RunConfig, fsdp: dict | None = None) -> nn.Module:
    """TP -> activation checkpointing -> (compile) -> EP -> FSDP on `part` (a `Transformer` or a pipeline
    stage's shell of one), in place; `fsdp` = `fully_shard` options, None for engines that do not shard
    with FSDP (single process, DDP, DeepSpeed). Returns `part`."""
    if layout.tp > 1:
        apply_tensor_parallel(part, layout.tp_mesh())
    apply_activation_checkpointing(part, cfg.memory.ac_every, cfg.memory.ac_selective)
    if cfg.train.compile:
        compile_blocks(part)
    expert_mesh = layout.expert_mesh() if layout.ep * layout.tp > 1 else None
    if expert_mesh is not None:
        apply_expert_parallel(part, expert_mesh)
    if fsdp is not None:
        apply_fsdp(part, **fsdp)
    return part


def _settled(module: nn.Module, args: tuple, out: DTensor) -> DTensor:
    """The embedding's output under tensor parallelism with its reduce-scatter waited for. TP's styles
    return it as a DTensor over an `AsyncCollectiveTensor`, so compiled block 0 got a graph of its own; under
    torch 2.13 the no-grad graph made for it at the first evaluation then also ran block 1's plain input and
    failed (AttributeError: 'Tensor' object has no attribute 'elem'). A copy (one B x S/tp x d activation)
    gives every block the same kind of input: one graph for all blocks."""
    return out.clone()


def compile_blocks(part: nn.Module, backend: str = "inductor") -> None:
    """torch.compile each block in place, its activation checkpointing included; after TP, the embedding's
    output is settled first (`_settled`).

    An MoE block's forward records its router statistics on the module (`MoE.last_stats`, `totals`), a side
    effect dynamo will not trace inside a checkpointed region unless told that recomputation need not replay
    it: without that, each MoE block under AC + compile breaks its graph at the checkpoint, which then runs
    outside the graph. Not replaying is what the statistics want (eager AC's recomputation already skips
    `_record`, and `last_stats` would be set to the same values), so the flag is set, as torchtitan's
    `apply_compile` does (`torch_compat.skip_side_effects_in_checkpoint_backward`)."""
    skip_side_effects_in_checkpoint_backward()
    embed = getattr(part, "embed_tokens", None)
    if embed is not None and isinstance(embed.weight, DTensor):  # tensor parallel (`_settled`)
        embed.register_forward_hook(_settled)
    for block in part.layers.values():
        block.compile(backend=backend)
    if isinstance(part, Transformer):  # and the loss, on CUDA (trainers.loss.lm_loss_compiled)
        part.compile_loss = True


def apply_tensor_parallel(part: Transformer, mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism over the 1-D `mesh` (see the module docstring)."""
    for block in part.layers.values():
        plan: dict[str, object] = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
        }
        if block.is_moe:  # the whole sequence in, whole outputs out (experts split in expert.py)
            plan["block_sparse_moe"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
                use_local_output=False,
            )
        else:
            plan |= {
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            }
        parallelize_module(block, mesh, plan)
    plan = {}
    if part.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    else:  # a later pipeline stage: its input is this rank's sequence shard of the hidden states
        parallelize_module(
            part,
            mesh,
            PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),)),
        )
    if part.norm is not None:
        plan["norm"] = SequenceParallel()
    if part.lm_head is not None:
        # Logits sharded on the vocabulary: the loss runs under loss_parallel (Engine.loss_context). A pipeline's
        # last stage returns them as plain local tensors (its schedule sends and keeps plain tensors).
        plan["lm_head"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=part.embed_tokens is None
        )
    else:  # an earlier pipeline stage: it returns its sequence shard as a plain tensor
        parallelize_module(
            part,
            mesh,
            PrepareModuleOutput(
                output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=True
            ),
        )
    if plan:
        parallelize_module(part, mesh, plan)


def apply_fsdp(model: nn.Module, **options) -> nn.Module:
    """Shard each transformer block (its own all-gather / reduce-scatter unit, so communication of one
    block overlaps compute of the next and, at stage 3, one block's full weights exist at a time), then
    the root, which takes what no block claimed: embeddings, final norm, output head.

    Blocks may already be activation-checkpoint wrappers: FSDP sits outside AC, so recomputation in
    backward runs inside the block's all-gathered window. Expert-parallel weights are left out (see
    `trainers.parallel.expert`)."""
    for block in model.layers.values():
        fully_shard(block, **options, **_ignoring(expert_params(block)))
    fully_shard(model, **options, **_ignoring(expert_params(model)))
    return model


def _ignoring(params: list[nn.Parameter]) -> dict:
    return {"ignored_params": set(params)} if params else {}
