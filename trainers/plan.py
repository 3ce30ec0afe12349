"""Memory per rank before anything starts: arithmetic over the run config (no model is built, no ray).

`plan_memory(cfg, world_size)` predicts the peak bytes one rank's device holds in a training step, by kind
(`KINDS`); `plan_run` adds a verdict against the device's memory and, when it does not fit, the cheapest
change that does, found by re-planning the rungs of `memory_ladder`: the one ordered list of what lowers the
peak, each priced by `predicted_step_s`, that `raytrain plan` explains and `memory.fit: auto`
(`trainers.autofit`) applies.

The peak is the largest of three kinds of moment, each the sum of what is live then: backward start (the
saved activations of every micro-batch in flight, the loss's buffers); backward of block i (the blocks
before i saved, block i whole, the gradients of the blocks after i; under FSDP also the block's gradient
reduction); the optimizer step (parameters, gradients, optimizer state, the step's temporaries).

Activations per block follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), redone for the tensors autograd saves in `trainers/models/llama.py` and `moe.py`
(`block_activation_bytes`). The layout is `trainers.layout.ParallelLayout.of`'s (a layout the workers would
refuse is refused here with their line); parameters are counted by `trainers.models.flops`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from trainers._base import ConfigError, format_bytes, parse_bytes  # sizes live in _base; importable here too
from trainers.config import RunConfig, apply_overrides, parse_config
from trainers.layout import ParallelLayout, block_costs, split_stages
from trainers.models.flops import (
    block_params,
    block_shapes,
    embed_params,
    embed_shapes,
    expert_params,
    flops_per_token,
    head_params,
    head_shapes,
    param_count,
    param_shapes,
)
from trainers.sections.model import ModelConfig

__all__ = ["GPUS_PER_NODE", "KINDS", "MemoryChange", "MemoryPlan", "RunPlan", "Widths",
           "block_activation_bytes", "compiled_block_bytes", "format_bytes", "layout_dict", "memory_ladder",
           "parse_bytes", "plan_memory", "plan_run", "predicted_step_s", "replan", "selective_saved_bytes",
           "widths"]

DeviceType = Literal["cuda", "cpu"]
KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers")
# Of the device's memory, what the planned peak may use: a margin for what the planner does not count
# (the CUDA context, NCCL's buffers, the allocator's fragmentation).
USABLE_FRACTION = 0.9
# cuBLAS's and cuBLASLt's workspaces (32 MiB each on Hopper) come from torch's caching allocator, so
# max_memory_allocated counts them; the CUDA context (~0.5 GiB) is outside it: USABLE_FRACTION's margin.
CUDA_WORKSPACE_BYTES = 2 * 32 * 2**20
GPUS_PER_NODE = 8  # a node's GPUs when not told (an H100 node): bounds the tensor-parallel degrees suggested
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "adagrad": 1}  # fp32 tensors per parameter
_DEEPSPEED_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size / allgather_bucket_size
# DeepSpeed stage 3 defaults: parameters under this many elements stay whole on every rank, and parameters
# reused within this many elements of fetches are not released after forward.
_DS_PERSISTENCE, _DS_REUSE = 100_000, 1_000_000_000


# ------------------------------------------------------------------------------------ precision


@dataclass(frozen=True)
class Widths:
    """Bytes per element of what the step holds, from precision.dtype and the engine."""

    compute: int  # matmul inputs and outputs
    resid: int  # the residual stream (what a checkpointed block keeps, what a pipeline stage sends)
    gathered: int  # a parameter as the forward sees it (FSDP all-gather / DeepSpeed's 16-bit module)
    autocast: bool  # per-op casts: each projection saves its own 16-bit copy of its input and weight


def widths(cfg: RunConfig) -> Widths:
    dtype, engine = cfg.precision.dtype, cfg.parallel.engine
    if dtype == "fp32":
        return Widths(4, 4, 4, False)
    if engine == "deepspeed" or (engine == "fsdp" and dtype == "bf16"):
        # The whole forward runs on 16-bit weights (FSDP's param_dtype, DeepSpeed's 16-bit module).
        return Widths(2, 2, 2, False)
    return Widths(2, 4, 4, True)  # autocast over fp32 weights (none, ddp, fsdp fp16)


# ---------------------------------------------------------------------------------- activations


def _kept_per_token(model: ModelConfig, tokens: int) -> float:
    """Expert assignments kept per token: top_k when dropless, else at most E * capacity / tokens."""
    moe = model.moe
    if moe.capacity_factor is None:
        return float(moe.top_k)
    capacity = math.ceil(tokens * moe.top_k / moe.num_experts * moe.capacity_factor)
    return min(float(moe.top_k), moe.num_experts * capacity / tokens)


def _moe_rows_per_token(model: ModelConfig, tokens: int) -> float:
    """Rows the experts run per token: the grouped path (impl grouped or auto) keeps every assignment's row
    (static shapes: those over capacity get zeros), the loop only the kept ones."""
    return _kept_per_token(model, tokens) if model.moe.impl == "loop" else float(model.moe.top_k)


def _ffn_saved_per_token(model: ModelConfig, layer_id: int, tokens: int, w: Widths, tp: int = 1) -> float:
    """Bytes the feed-forward half of a block saves per token (after its RMSNorm). Under tensor parallelism
    only the SwiGLU widths divide by tp: the input is whole-sequence and every tp rank routes all of it."""
    h, f = model.dim, model.hidden_dim // tp
    if not model.is_moe_layer(layer_id):
        # norm output (cast once per projection under autocast) + gate, up, silu(gate), silu*up
        return (2 if w.autocast else 1) * h * w.compute + 4 * f * w.compute
    e, rows = model.moe.num_experts, _moe_rows_per_token(model, tokens)
    grouped = model.moe.impl != "loop"
    # top-k > 1 renormalises the top-k weights: the division keeps them and their sum for backward
    renormalised = model.moe.top_k + 1 if model.moe.top_k > 1 else 0
    router = (h * w.compute  # the router's input
              + 4 * (2 * e + rows + 1 + renormalised)  # fp32 logits, probs, the rows' weights, logsumexp (z-loss)
              + 8 * (model.moe.top_k + 2 * rows))  # int64 expert ids and the token ids of the expert rows
    # tokens sorted by expert: the loop casts each expert's rows per projection, grouped casts them once
    # (and, with a capacity, a bool per row: inside the groups or not; its 4E bytes of offsets left out)
    mask = rows if grouped and model.moe.capacity_factor is not None else 0
    gathered = (1 if grouped or not w.autocast else 2) * rows * h * w.compute + mask
    experts = 4 * rows * f * w.compute  # SwiGLU of each expert row (this tp rank's hidden units)
    combine = rows * h * w.compute  # expert outputs (summed over tp) back in token order: the router weights' gradient reads them
    return router + gathered + experts + combine


def _sequence_shard(tokens: int, tp: int, seq_len: int | None) -> float:
    """Tokens of a micro-batch one tp rank holds under sequence parallelism (torch.chunk: ceil)."""
    if tp == 1:
        return tokens
    if not seq_len:
        return tokens / tp
    return tokens // seq_len * math.ceil(seq_len / tp)


def block_activation_bytes(model: ModelConfig, layer_id: int, tokens: int, w: Widths,
                           seq_len: int | None = None, tp: int = 1) -> int:
    """Bytes autograd saves for one block's backward, for `tokens` = micro-batch x sequence length.

    Per token, with h = dim, a = heads, hkv = kv_heads * head_dim, f = ffn width (fp32: 4 bytes each):
      RMSNorm (computes in fp32 whatever the dtype), both norms: input and x*rsqrt(mean x^2): 4h; rsqrt: 2
      attention (w.compute): norm output h (x3 casts under autocast), q h, k hkv, v hkv (after RoPE, as
      SDPA saves them), SDPA output h (= o_proj's input); logsumexp a values in fp32
      feed-forward: `_ffn_saved_per_token` (dense: norm output + 4f; MoE: router + k kept copies)
      autocast: the 16-bit copy of every matmul weight; 16-bit: RoPE's cos/sin cast for q and for k
    fp32 dense total: 4 * (8h + 2hkv + 4f + 2 + a) bytes per token (Megatron's GPT block: 34h + 5as).

    Under tensor parallelism with sequence parallelism (as Korthikanti et al.) the norms run on 1/tp of the
    tokens and heads / hidden units are split; but where Megatron re-gathers the norm output in backward,
    torch's DTensor saves the all-gathered inputs of q/k/v and gate/up (or the MoE), whole-sequence.
    """
    h, a = model.dim, model.n_heads // tp  # a: this rank's query heads
    hq, hkv = a * model.head_dim, model.kv_heads // tp * model.head_dim
    qkv_input = (3 if w.autocast else 1) * h * w.compute
    attention = qkv_input + (2 * hq + 2 * hkv) * w.compute + 4 * a
    per_token = attention + _ffn_saved_per_token(model, layer_id, tokens, w, tp)
    norms = 4 * (4 * h + 2) * _sequence_shard(tokens, tp, seq_len)
    matmul_weights = sum(s.local_numel(tp) for s in block_shapes(model, layer_id) if len(s.shape) > 1)
    weights = 2 * matmul_weights if w.autocast else 0  # the norms' stay fp32
    rope = 4 * (seq_len or 0) * model.head_dim * w.compute if w.compute != 4 else 0
    return int(tokens * per_token + norms) + weights + rope


def selective_saved_bytes(model: ModelConfig, layer_id: int, tokens: int, w: Widths, tp: int = 1) -> int:
    """Bytes selective checkpointing keeps of one block besides its input (trainers/parallel/ac.py): the
    outputs of every matmul (MoE: the router's logits, each kept assignment's expert matmuls) and of attention
    with its logsumexp. Under tp o_proj's and down's outputs are whole-sequence partial sums."""
    h, a = model.dim, model.n_heads // tp
    hq, hkv = a * model.head_dim, model.kv_heads // tp * model.head_dim
    attention = (2 * hq + 2 * hkv + h) * w.compute + 4 * a
    f = model.hidden_dim // tp
    if model.is_moe_layer(layer_id):
        k = _kept_per_token(model, tokens)
        ffn = model.moe.num_experts * w.compute + k * (2 * f + h) * w.compute
    else:
        ffn = (2 * f + h) * w.compute
    return int(tokens * (attention + ffn))


def compiled_block_bytes(model: ModelConfig, layer_id: int, tokens: int, w: Widths, seq_len: int | None = None,
                         tp: int = 1) -> int:
    """Bytes a block compiled by inductor (`train.compile`, CUDA) saves: its min-cut partitioner keeps the
    matmuls' inputs and outputs (selective checkpointing's set, the norm outputs feeding q/k/v and gate/up,
    down's input) and recomputes the pointwise ops. H100, 1.1B, bf16: 1.23 GB per block measured, 1.226 GB
    by this count (eager's 1.96 GB). MoE layers and tp > 1 keep the eager count."""
    if model.is_moe_layer(layer_id) or tp > 1:
        return block_activation_bytes(model, layer_id, tokens, w, seq_len, tp)
    h, f = model.dim, model.hidden_dim
    kept = selective_saved_bytes(model, layer_id, tokens, w) + tokens * (2 * h + f) * w.compute
    return kept + tokens * h * w.resid  # and the block's input


def _head_saved(model: ModelConfig, tokens: int, w: Widths, tp: int = 1, seq_len: int | None = None,
                chunk: int = 0, compiled: bool = False) -> int:
    """Final RMSNorm (fp32 input, x*rsqrt, rsqrt; output) and the loss: cross_entropy saves log_softmax's fp32
    output (the model returns the loss, so the logits are freed), this rank's vocabulary share under tp. A
    chunked loss (trainers/loss.py) saves only the gradients it made in forward: d(hidden), d(head weight) in
    fp32. Compiled (trainers.loss.lm_loss_compiled): its input, the logits in the head's dtype, logsumexp."""
    norm = _sequence_shard(tokens, tp, seq_len) * 4 * (2 * model.dim + 1)
    vocab = _vocab_share(model, tp)
    if chunk:  # under tp: d(hidden) of the whole sequence, d(head weight) of this rank's rows
        return int(norm) + tokens * model.dim * w.resid + 4 * vocab * model.dim
    loss = tokens * (vocab * w.compute + 4) if compiled else tokens * vocab * 4
    return int(norm) + tokens * model.dim * w.compute + loss


def _vocab_share(model: ModelConfig, tp: int) -> int:
    """Vocabulary rows of the embedding / head on the largest tp rank (torch.chunk: ceil)."""
    return math.ceil(model.vocab_size / tp)


def _head_backward_temp(model: ModelConfig, tokens: int, w: Widths, tp: int = 1, chunk: int = 0,
                        compiled: bool = False) -> int:
    """The loss's gradient buffers: d(log_softmax) and d(logits) in fp32 (the 16-bit cast of d(logits) comes
    after both are freed: measured in bench/lean.py); compiled, one d(logits) in the head's dtype. Chunked:
    the larger of one chunk's forward (fp32 logits, hidden states, d(hidden); compiled, as in trainers.loss.
    _chunk_group_traced: logits and their gradient in 16 bits, a head-sized product) and the scaled copies
    of the saved gradients its backward returns."""
    rows = _vocab_share(model, tp)
    if chunk:
        c = min(chunk, tokens)
        if compiled:
            forward = 2 * c * rows * w.compute + (rows * model.dim * w.compute if w.compute < 4 else 0)
        else:
            forward = c * rows * 4 + 2 * c * model.dim * 4
        return max(forward, tokens * model.dim * w.resid + 4 * rows * model.dim)
    return tokens * rows * (w.compute if compiled else 8)


def compiled_loss(cfg: RunConfig, lay: ParallelLayout, device_type: str) -> bool:
    """Whether the run's whole loss is compiled (trainers.loss.lm_loss_compiled): `train.compile` on CUDA,
    the model's own loss (not a pipeline schedule's), logits not vocabulary-parallel, not chunked."""
    return bool(cfg.train.compile and device_type == "cuda" and lay.pp == 1 and lay.tp == 1
                and not cfg.memory.loss_chunk)


def _block_backward_temp(model: ModelConfig, layer_id: int, tokens: int, w: Widths, tp: int = 1,
                         ep: int = 1) -> int:
    """Gradients through one block's backward at its widest: one SwiGLU hidden and one residual-width (whole-
    sequence under tp) gradient per expert row. MoE weight gradients: the loop's `w1[e]` gives each expert's
    back through select_backward as a zero-filled stacked-size tensor (measured: 2 alive at once); grouped_mm
    returns one stacked gradient (and, under autocast, its cast)."""
    f = model.hidden_dim // tp
    if not model.is_moe_layer(layer_id):
        return tokens * (f + model.dim) * w.compute
    rows = _moe_rows_per_token(model, tokens)
    stacked = math.ceil(model.moe.num_experts / ep) * f * model.dim
    weight_grads = 2 * w.gathered if model.moe.impl == "loop" else w.gathered + (w.compute if w.autocast else 0)
    return int(tokens * rows * (f + model.dim) * w.compute) + stacked * weight_grads


# ------------------------------------------------------------------------------- pipeline ranks


@dataclass(frozen=True)
class _Rank:
    """What one pipeline rank holds: its blocks, whether it embeds / computes the loss, and how many
    micro-batches' activations it keeps at once (fractional for interleaved schedules)."""

    index: int
    blocks: tuple[int, ...]
    embeds: bool
    head: bool
    in_flight: float


def _in_flight(lay: ParallelLayout, r: int) -> float:
    """Micro-batches whose activations a rank holds at its peak, in units of all its blocks. GPipe: every
    microbatch. 1F1B: p - r (Narayanan et al. 2021). Interleaved with v chunks per rank: Megatron's warmup of
    2(p - r - 1) + (v - 1)p chunks, plus one (the paper's factor). Zero-bubble V: as 1F1B (Qi et al. 2024)."""
    p, v, m = lay.pp, lay.virtual_stages, lay.microbatches
    if p == 1:
        return 1.0
    if lay.pipeline_schedule == "gpipe":
        return float(m)
    if lay.pipeline_schedule in ("interleaved_1f1b", "interleaved_zb"):
        return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) / v
    return float(min(m, p - r))


# ---------------------------------------------------------------------------------- model states


@dataclass
class _States:
    """Per-rank model-state bytes: on the device and moved to the host by offload."""

    parameters: int = 0
    gradients: int = 0  # complete (after the step's last backward)
    optimizer: int = 0
    host: dict[str, int] = field(default_factory=dict)
    step_temp: int = 0  # only during the optimizer step
    persistent_buffers: int = 0  # e.g. DDP's gradient buckets


# --------------------------------------------------------------------------------------- the plan


@dataclass
class MemoryPlan:
    """Peak device bytes of the worst rank, what they are made of, and the numbers behind them."""

    world_size: int
    layout: dict[str, Any]
    rank: int  # the pipeline rank with the largest peak (0 without a pipeline)
    peak_bytes: int
    moment: str  # when the peak happens
    breakdown: dict[str, int]  # KINDS at the peak moment; they sum to peak_bytes
    buffers: dict[str, int]  # what "buffers" holds at the peak moment
    host_bytes: dict[str, int]  # moved to CPU memory by offload
    model_states: dict[str, int]  # on the device once backward is done, and what the optimizer step adds
    activations: dict[str, Any]
    moe: dict[str, Any] | None
    moments: dict[str, int]
    assumptions: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_memory(cfg: RunConfig, world_size: int, device_type: DeviceType = "cuda",
                grads_kept: bool = False) -> MemoryPlan:
    """Peak memory per rank of one training step of `cfg` on `world_size` ranks (the worst rank).
    `grads_kept`: a loop that zeroes gradients, not frees them (`set_to_none=False`), holds them all."""
    return _Planner(cfg, world_size, device_type).plan(grads_kept)


_Moment = tuple[dict[str, int], dict[str, int]]  # (bytes by kind except buffers, buffers by name)


class _RankPlanner:
    """The moments of one pipeline rank's step (all ranks alike without a pipeline), in its run's `_Planner`."""

    def __init__(self, planner: _Planner, rank: _Rank, grads_kept: bool = False):
        cfg, lay, device_type = planner.cfg, planner.lay, planner.device_type
        self.planner, self.cfg, self.lay, self.device_type = planner, cfg, lay, device_type
        self.rank, self.grads_kept = rank, grads_kept
        model, self.w, seq, tp, ep = cfg.model, planner.w, cfg.data.seq_len, lay.tp, lay.ep
        self.tokens = lay.microbatch_size * seq  # whole sequences: what attention and the MLP see
        # The residual stream between blocks: this rank's sequence shard under tensor parallelism.
        self.shard_tokens = int(_sequence_shard(self.tokens, tp, seq))
        every, self.chunk = cfg.memory.ac_every, cfg.memory.loss_chunk
        self.checkpointed = {b for b in rank.blocks if every and b % every == 0 or cfg.memory.ac_selective}
        compiled = cfg.train.compile and device_type == "cuda"  # inductor saves less than eager
        count = compiled_block_bytes if compiled else block_activation_bytes
        self.full = {b: count(model, b, self.tokens, self.w, seq, tp) for b in rank.blocks}
        # the loss runs compiled: whole (`compiled_loss`) or chunked (CUDA: trainers.loss._runner; under tp the
        # vocabulary-parallel chunks, `_vp_chunks`, stay eager)
        self.compiled_loss = compiled_loss(cfg, lay, device_type) or bool(
            self.chunk and device_type == "cuda" and tp == 1)
        self.block_input = self.shard_tokens * model.dim * self.w.resid
        selective = cfg.memory.ac_selective  # also the outputs of the block's matmuls and attention
        self.kept = {b: self.block_input + (selective_saved_bytes(model, b, self.tokens, self.w, tp)
                                            if selective else 0) for b in rank.blocks}
        self.saved = {b: self.kept[b] if b in self.checkpointed else self.full[b] for b in rank.blocks}
        self.head_saved = (_head_saved(model, self.tokens, self.w, tp, seq, self.chunk, self.compiled_loss)
                           if rank.head else 0)
        # token ids and targets (int64); under tp the vocabulary-parallel embedding also keeps its masked ids
        self.token_ids = self.tokens * (16 if tp == 1 else 24) if rank.embeds else 0
        self.edge = self.token_ids + self.head_saved
        # Parameters (this rank's tp share of each tensor): `sharded` ones go through the data-parallel
        # engine; with ep > 1 the experts stay whole on their ep rank instead (1/ep of them, 1/tp of units).
        shapes = {b: block_shapes(model, b) for b in rank.blocks}
        self.local_experts = {b: sum(s.local_numel(tp, ep) for s in shapes[b] if s.expert) for b in rank.blocks}
        self.sharded = {b: sum(s.local_numel(tp) for s in shapes[b] if not (ep > 1 and s.expert))
                        for b in rank.blocks}
        self.local = {b: self.sharded[b] + (self.local_experts[b] if ep > 1 else 0) for b in rank.blocks}
        root = (embed_shapes(model) if rank.embeds else []) + (head_shapes(model) if rank.head else [])
        self.root = sum(s.local_numel(tp) for s in root)
        self.head = sum(s.local_numel(tp) for s in head_shapes(model)) if rank.head else 0
        self.params = sum(self.local.values()) + self.root  # this rank's stage, unsharded
        dense = sum(self.sharded.values()) + self.root
        self.states = planner.model_states(dense, self.params - dense)
        self.grad_per_param = self.states.gradients / max(self.params, 1)
        self.others = (rank.in_flight - 1) * (sum(self.saved.values()) + self.edge)  # other micro-batches

    # -------------------------------------------------------------------------------- moments

    def moments(self) -> dict[str, _Moment]:
        out = {"backward start": self.backward_start()}
        done = 0  # gradient bytes of the blocks already through backward
        for prev, b in zip((None, *reversed(self.rank.blocks)), reversed(self.rank.blocks)):
            out[f"backward of block {b}"] = self.block_backward(b, prev, done)
            if self._fsdp:
                out[f"gradient reduction of block {b}"] = self.block_reduction(b, done)
            done += self.grad_per_param * self.local[b]
        out["optimizer step"] = self.optimizer_step()
        return out

    def backward_start(self) -> _Moment:
        """Every micro-batch's saved activations and the loss's gradient buffers; without the head (a pipeline
        stage before the last), the last block's backward starting (recomputed first, if checkpointed). With
        the head, the last block is recomputed after the loss's backward: `block_backward` has that moment."""
        last = self.rank.blocks[-1]  # every rank holds a block (`split_stages`)
        acts = self.others + sum(self.saved.values()) + self.edge
        if self.rank.head:
            temp = _head_backward_temp(self.cfg.model, self.tokens, self.w, self.lay.tp, self.chunk,
                                       self.compiled_loss)
        else:
            if last in self.checkpointed:
                acts += self.full[last] - self.kept[last]  # recomputed at once
            temp = self._block_temp(last)
        gathered = self._gathered(last, reducing=False)
        return self._kinds(self._grads(0), acts), {**gathered, **self._always(), "backward temporaries": temp}

    def block_backward(self, b: int, after: int | None, done: float) -> _Moment:
        """Block b's backward: its activations whole, earlier blocks' saved, later blocks' gradients;
        FSDP2 keeps the reduce-scatter input of the block reduced before (`after`) until the next."""
        acts = self.others + self._earlier(b) + self.full[b]
        bufs = {**self._gathered(b, reducing=False), **self._always(),
                "backward temporaries": self._block_temp(b)}
        if self._fsdp and after is not None:
            bufs["reduce-scatter buffer"] = 4 * self.sharded[after]
        return self._kinds(self._grads(done), acts), bufs

    def block_reduction(self, b: int, done: float) -> _Moment:
        """FSDP2's post-backward of block b: its parameters resharded, its unsharded gradients copied
        into a flat fp32 reduce-scatter input."""
        bufs = {**self._gathered(b, reducing=True), **self._always(),
                "unsharded block gradients": self.w.gathered * self.sharded[b],
                "reduce-scatter buffer": 4 * self.sharded[b]}
        return self._kinds(self._grads(done), self.others + self._earlier(b)), bufs

    def optimizer_step(self) -> _Moment:
        return self._kinds(self.states.gradients, 0), {**self._always(), "optimizer step": self.states.step_temp}

    # -------------------------------------------------------------------------------- pieces

    def _block_temp(self, b: int) -> int:
        return _block_backward_temp(self.cfg.model, b, self.tokens, self.w, self.lay.tp, self.lay.ep)

    @property
    def _fsdp(self) -> bool:
        """FSDP reduce-scatters block by block (under a pipeline only once, after the last microbatch:
        the unsharded gradients are counted whole then, in `_grads`)."""
        return self.cfg.parallel.engine == "fsdp" and self.lay.dp > 1 and self.lay.pp == 1

    def _earlier(self, b: int) -> int:
        """Saved activations of the blocks before b and the token ids (the loss's are freed by its backward)."""
        return sum(self.saved[x] for x in self.rank.blocks if x < b) + self.token_ids

    def _kinds(self, gradients: float, activations: float) -> dict[str, int]:
        return {"parameters": self.states.parameters, "gradients": int(gradients),
                "optimizer": self.states.optimizer, "activations": int(activations)}

    def _grads(self, done: float) -> float:
        """Gradient bytes during backward: those of the blocks already done, plus the head's (FSDP2 reduces
        the root's only at the end), or all of them while earlier micro-batches' are kept (accumulation;
        FSDP's unsharded accumulation and pipelines keep whole fp32 gradients)."""
        par = self.cfg.parallel
        if self.grads_kept:
            return self.states.gradients
        if self.lay.accumulation > 1 or self.lay.pp > 1:
            if not par.sharded_accumulation:
                return 4 * self.params if par.engine == "fsdp" else self.states.gradients
            done = self.states.gradients  # every shard exists from the first micro-batch on
        return done + (self.w.gathered if self._fsdp else self.grad_per_param) * self.head

    def _gathered(self, current: int, reducing: bool) -> dict[str, int]:
        """Unsharded parameters (FSDP; DeepSpeed stage 3) around block `current`'s backward: FSDP2 keeps the
        root's gathered from forward to backward; zero2 keeps each block gathered until its post-backward;
        zero3 re-gathers a block for its backward and prefetches the next one's meanwhile."""
        engine, stage, width = self.cfg.parallel.engine, self.cfg.parallel.stage, self.w.gathered
        if self.lay.dp == 1 or engine in ("none", "ddp") or (engine == "deepspeed" and stage < 3):
            return {}
        if self.lay.pp > 1:  # torch's pipelining keeps a stage gathered across the step's microbatches
            return {"gathered parameters": width * (self.root + sum(self.sharded.values()))}
        blocks = [b for b in self.rank.blocks if b <= current]
        # DeepSpeed stage 3 keeps a parameter gathered from forward to backward when the elements fetched in
        # between (at most twice the stage's) stay within `stage3_max_reuse_distance`
        keeps = stage == 2 if engine == "fsdp" else 2 * self.params <= self.planner.deepspeed_setting(
            "stage3_max_reuse_distance", _DS_REUSE)
        if keeps:
            live = [b for b in blocks if not (reducing and b == current)]
        else:
            live = blocks[-2:] if not reducing else blocks[-2:-1]  # (current and) the prefetched one
        return {"gathered parameters": width * (self.root + sum(self.sharded[b] for b in live))}

    def _always(self) -> dict[str, int]:
        out, model = {}, self.cfg.model
        if self.device_type == "cuda":
            out["CUDA library workspaces"] = CUDA_WORKSPACE_BYTES
        if self.states.persistent_buffers:
            out["gradient buckets"] = self.states.persistent_buffers
        if self.lay.pp > 1:  # under tp a stage sends and receives its sequence shard
            out["pipeline send/recv"] = 2 * self.shard_tokens * model.dim * self.w.resid
        if self.lay.ep > 1 and model.moe is not None:
            k = _kept_per_token(model, self.tokens)
            out["expert all-to-all"] = int(2 * self.tokens * k * model.dim * self.w.compute)
        return out

    # ---------------------------------------------------------------------------------- result

    def plan(self) -> MemoryPlan:
        moments = self.moments()
        totals = {k: int(sum(v[0].values()) + sum(v[1].values())) for k, v in moments.items()}
        name = max(totals, key=totals.get)
        kinds, bufs = moments[name]
        bufs = {k: int(v) for k, v in bufs.items() if v}
        breakdown = {**kinds, "buffers": sum(bufs.values())}
        st, rank = self.states, self.rank
        return MemoryPlan(
            world_size=self.lay.world_size,
            layout=layout_dict(self.lay),
            rank=rank.index,
            peak_bytes=sum(breakdown.values()),
            moment=name,
            breakdown={k: int(breakdown[k]) for k in KINDS},
            buffers=bufs,
            host_bytes=st.host,
            model_states={"parameters": st.parameters, "gradients": st.gradients, "optimizer": st.optimizer,
                          "optimizer_step_temporaries": st.step_temp},
            activations={
                "per_block_bytes": {str(b): self.full[b] for b in rank.blocks},
                "checkpointed_block_bytes": self.block_input,
                "checkpointed_blocks": len(self.checkpointed),
                "blocks": len(rank.blocks),
                "micro_batch_tokens": self.tokens,
                "in_flight_microbatches": rank.in_flight,
                "loss_and_head_bytes": self.head_saved,
                "selective_kept_block_bytes": ({str(b): self.kept[b] for b in rank.blocks}
                                               if self.cfg.memory.ac_selective else None),
                "residual_stream_tokens": self.shard_tokens,
            },
            moe=self._moe(),
            moments=totals,
            assumptions=self.planner.assumptions(),
        )

    def _moe(self) -> dict[str, Any] | None:
        moe, model = self.cfg.model.moe, self.cfg.model
        if moe is None:
            return None
        whole_root = (embed_params(model) if self.rank.embeds else 0) + (head_params(model) if self.rank.head else 0)
        experts = sum(expert_params(model, b) for b in self.rank.blocks)  # whole
        return {
            "experts_per_rank": moe.num_experts // self.lay.ep,
            "expert_parameters": experts,
            # before data-parallel sharding: this rank's ep share of the experts, tp share of their units
            "expert_parameters_on_rank": sum(self.local_experts.values()),
            "expert_share_of_parameters": experts / max(sum(block_params(self.cfg.model, b)
                                                            for b in self.rank.blocks) + whole_root, 1),
            "kept_assignments_per_token": _kept_per_token(self.cfg.model, self.tokens),
        }


def layout_dict(lay: ParallelLayout) -> dict[str, Any]:
    """The layout's degrees and step arithmetic, as `raytrain plan --json` reports them."""
    return {"world_size": lay.world_size, "pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "ep": lay.ep, "edp": lay.edp,
            "schedule": lay.pipeline_schedule, "virtual_stages": lay.virtual_stages, "num_stages": lay.num_stages,
            "microbatches": lay.microbatches, "microbatch_size": lay.microbatch_size,
            "accumulation": lay.accumulation}


# ---------------------------------------------------------------------------------------- verdict


@dataclass
class RunPlan:
    """A plan, the verdict against a device's memory, and the cheapest change that makes it fit."""

    plan: MemoryPlan
    device_memory_bytes: int
    usable_bytes: int
    fits: bool
    change: dict[str, Any] | None  # {"set": {...}, "why": ..., "peak_bytes": ..., "fits": True} or None
    candidates: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {**self.plan.to_dict(), "device_memory_bytes": self.device_memory_bytes,
                "usable_bytes": self.usable_bytes, "fits": self.fits, "change": self.change,
                "candidates": self.candidates}


def plan_run(cfg: RunConfig, world_size: int, device_memory: int, device_type: DeviceType = "cuda",
             raw: dict[str, Any] | None = None, gpus_per_node: int = GPUS_PER_NODE) -> RunPlan:
    """Plan, compare with `device_memory` (x USABLE_FRACTION) and, if it does not fit, name the first rung of
    the memory ladder that fits. `gpus_per_node` bounds the tensor-parallel degrees suggested."""
    planner = _Planner(cfg, world_size, device_type)
    plan, usable = planner.plan(), int(device_memory * USABLE_FRACTION)
    fits = plan.peak_bytes <= usable
    candidates = [] if fits else planner.candidates(usable, raw, gpus_per_node)
    change = next((c for c in candidates if c["fits"]), None)
    return RunPlan(plan, device_memory, usable, fits, change, candidates)


# ------------------------------------------------------------------------------ the memory ladder


@dataclass(frozen=True)
class MemoryChange:
    """One rung of the memory ladder: settings that lower the peak per rank, why (one line), and its price."""

    sets: dict[str, Any]  # dotted config key -> new value
    why: str
    cost: float | None = None  # extra step time, a fraction (`predicted_step_s`); None: unseen by that model
    activations: bool = False  # only the activations change: `memory.fit: auto` may take it by itself


# Activation rungs predicted to cost less than this share of a step come before sharding the model states.
CHEAP_COST = 0.05


def memory_ladder(cfg: RunConfig, world_size: int, device_type: DeviceType = "cuda",
                  gpus_per_node: int = GPUS_PER_NODE) -> list[MemoryChange]:
    """Every change that lowers this run's peak per rank, each alone, cheapest first: the one list that
    `plan_run` explains and `memory.fit: auto` applies. By cost: activation rungs under CHEAP_COST of a step;
    sharding the model states (its traffic overlaps compute); the costlier activation rungs; last what puts
    its cost on the critical path: tensor parallelism inside a node (4 activation collectives per block each
    way, not overlapped), more pipeline stages (the bubble (p-1)/m grows), CPU offload (over PCIe)."""
    return _Planner(cfg, world_size, device_type).ladder(gpus_per_node)


def replan(raw: dict[str, Any], sets: dict[str, Any], world_size: int, device_type: DeviceType
           ) -> tuple[RunConfig, int] | None:
    """The config `raw` (as JSON) with `sets` applied, and its planned peak; None when that is not a valid
    run (e.g. a pp the world size refuses, a micro-batch a pipeline refuses)."""
    try:
        cfg = _changed(raw, sets)
        return cfg, plan_memory(cfg, world_size, device_type).peak_bytes
    except ConfigError:
        return None


def _changed(raw: dict[str, Any], sets: dict[str, Any]) -> RunConfig:
    return parse_config(apply_overrides(raw, [f"{k}={v}" for k, v in sets.items()]))


# ------------------------------------------------------------------------------------ the planner


class _Planner:
    """One run at one world size: its config and layout, its pipeline ranks and the model states each holds, what
    its plan assumes, and the rungs of its memory ladder. `_RankPlanner` plans each pipeline rank from it."""

    def __init__(self, cfg: RunConfig, world_size: int, device_type: DeviceType = "cuda"):
        if world_size < 1:
            raise ConfigError(f"world size {world_size} must be at least 1; fix: the number of ranks, e.g. 8")
        self.cfg, self.world_size, self.device_type, self.w = cfg, world_size, device_type, widths(cfg)
        self.lay = ParallelLayout.of(cfg, world_size)  # every layout rule: the same line as the workers'

    def plan(self, grads_kept: bool = False) -> MemoryPlan:
        """The plan of the rank with the largest peak."""
        return max((_RankPlanner(self, r, grads_kept).plan() for r in self.ranks()), key=lambda p: p.peak_bytes)

    def ranks(self) -> list[_Rank]:
        """Blocks per pipeline rank as the pipeline engine splits them and the layout assigns its stages."""
        cfg, lay = self.cfg, self.lay
        if lay.pp == 1:
            return [_Rank(0, tuple(range(cfg.model.n_layers)), True, True, 1.0)]
        stages = lay.num_stages
        split = split_stages(block_costs(cfg.model, cfg.data.seq_len), stages)
        out = []
        for r in range(lay.pp):
            ids = lay.stage_ids(pp_rank=r)
            blocks = tuple(b for s in ids for b in split[s])
            out.append(_Rank(r, blocks, 0 in ids, stages - 1 in ids, _in_flight(lay, r)))
        return out

    def model_states(self, dense: int, experts: int) -> _States:
        """`dense`: parameters the data-parallel engine shards over dp; `experts`: this rank's expert
        parameters when ep > 1 (kept whole: replicated over the dp/ep ranks holding the same experts)."""
        cfg, dp = self.cfg, self.lay.dp
        engine, offload = cfg.parallel.engine, cfg.parallel.offload
        n_opt = _OPTIMIZER_STATES.get(cfg.optimizer.name, 0)
        if cfg.optimizer.name in ("sgd", "rmsprop"):
            n_opt = (cfg.optimizer.momentum > 0) + (cfg.optimizer.name == "rmsprop")
        if engine == "deepspeed":
            st = self.deepspeed_states(dense, n_opt)
        else:  # fp32 states (autocast copies are activations): FSDP's shard, or everything (none, ddp)
            held = (math.ceil(dense / dp) if engine == "fsdp" else dense) + experts
            st = _States(4 * held, 4 * held, 4 * n_opt * held)
            if engine == "fsdp" and offload == "all":
                st.host = {"parameters": st.parameters, "gradients": st.gradients, "optimizer": st.optimizer}
                st.parameters = st.gradients = st.optimizer = 0
            if engine == "ddp":
                st.persistent_buffers = 4 * held  # the reducer's flat gradient buckets
        local = st.parameters // 4 if engine != "deepspeed" else 0
        if local and n_opt and not cfg.optimizer.fused:  # fused: one kernel per parameter, in place
            # torch's foreach step (CUDA) makes one temporary per parameter (sqrt of the second moment);
            # the per-tensor step (CPU) two of the largest tensor's size (this rank's tp share of it).
            tp = self.lay.tp
            largest = max(_vocab_share(cfg.model, tp) * cfg.model.dim,
                          cfg.model.dim * cfg.model.hidden_dim // tp)
            largest = math.ceil(largest / dp) if engine == "fsdp" else largest  # a shard of it
            st.step_temp = 4 * local if self.device_type == "cuda" else 2 * 4 * min(largest, local)
        return st

    def deepspeed_states(self, p: int, n_opt: int) -> _States:
        """DeepSpeed ZeRO (stage_1_and_2.py, stage3.py): parameters and gradients in the training dtype, fp32
        partitions of the parameters and optimizer state, and at the step an fp32 copy of the gradient
        partition: the ZeRO paper's (2 + 2 + 12) bytes/param at 16-bit, 4 more at the step."""
        stage, offload, b = self.cfg.parallel.stage, self.cfg.parallel.offload, self.w.gathered
        part = math.ceil(p / self.lay.dp)
        params = b * (part if stage == 3 else p)
        grads = b * (part if stage >= 2 else p)
        master = 4 * (part if stage >= 1 else (p if b == 2 else 0))
        optimizer = 4 * n_opt * (part if stage >= 1 else p)
        st = _States(params, grads, master + optimizer)
        st.step_temp = 4 * part if stage >= 1 else 0
        if stage >= 1:  # the reduce bucket; our engine caps it at the model's size (at least 1e6 elements)
            st.persistent_buffers = b * int(min(_DEEPSPEED_BUCKET, max(param_count(self.cfg.model), 1e6)))
        if stage == 3:  # parameters under the persistence threshold are also whole on every rank
            threshold = self.deepspeed_setting("stage3_param_persistence_threshold", _DS_PERSISTENCE)
            st.parameters += b * sum(s.numel for s in param_shapes(self.cfg.model) if s.numel < threshold)
        if offload != "none":  # ZeRO-Offload: fp32 master, optimizer and step on the CPU
            st.host = {"optimizer": master + optimizer + st.step_temp}
            st.optimizer, st.step_temp = 0, 0
            if stage >= 2:  # the gradient partition is accumulated in CPU memory (fp32)
                st.host["gradients"], st.gradients = 4 * part, 0
        if offload == "all":
            st.host["parameters"], st.parameters = st.parameters, 0
        return st

    def deepspeed_setting(self, key: str, default: int) -> int:
        """A `zero_optimization` setting of `parallel.deepspeed_extra`, else DeepSpeed's default."""
        return int((self.cfg.parallel.deepspeed_extra.get("zero_optimization") or {}).get(key, default))

    def assumptions(self) -> list[str]:
        """What the plan takes for granted, one line each, as `raytrain plan` lists them."""
        cfg, lay, device_type = self.cfg, self.lay, self.device_type
        out = [f"optimizer step temporaries of torch's {'foreach' if device_type == 'cuda' else 'per-tensor'} "
               f"implementation ({device_type})"]
        if device_type == "cuda":
            out.append("CUDA: cuBLAS/cuBLASLt workspaces from the caching allocator; the CUDA context (~0.5 GiB) "
                       "and the allocator's fragmentation are left to the usable fraction's margin")
            if cfg.train.compile:
                out.append("train.compile: dense blocks save what inductor's partitioner keeps (matmul inputs and "
                           "outputs), not eager's per-op casts and norm internals")
        if cfg.model.moe is not None:
            out.append("MoE routing balanced: each expert gets tokens * top_k / num_experts assignments")
        if lay.ep > 1:
            out.append("experts are kept out of FSDP and whole on their ep rank")
        if lay.pp > 1:
            out.append(f"pipeline: {lay.pipeline_schedule}, {lay.microbatches} microbatches of "
                       "train.micro_batch_size")
        if lay.tp > 1:
            out.append(f"tensor parallelism over {lay.tp} ranks with sequence parallelism: norms and the "
                       "residual stream on 1/tp of the tokens; heads, FFN/expert hidden units and the vocabulary "
                       "split; the all-gathered inputs of q/k/v, gate/up (or the MoE) and the head saved whole "
                       "(torch's DTensor keeps them; Megatron re-gathers them in backward)")
        return out

    # ------------------------------------------------------------------------- the memory ladder

    def ladder(self, gpus_per_node: int = GPUS_PER_NODE) -> list[MemoryChange]:
        """`memory_ladder`'s rungs, in its order."""
        activations = self.activation_changes()
        return [
            *(c for c in activations if c.cost < CHEAP_COST),
            *self.sharding_changes(),
            *(c for c in activations if c.cost >= CHEAP_COST),
            *self.critical_path_changes(gpus_per_node),
        ]

    def candidates(self, usable: int, raw: dict[str, Any] | None,
                   gpus_per_node: int = GPUS_PER_NODE) -> list[dict[str, Any]]:
        """Each rung of the ladder alone, in its order; if none fits, rungs added up greedily in that order (a
        rung joins when it lowers the peak). A rung that is not a valid run is left out."""
        raw = raw if raw is not None else json.loads(self.cfg.model_dump_json())
        ladder, out = self.ladder(gpus_per_node), []
        for change in ladder:
            planned = replan(raw, change.sets, self.world_size, self.device_type)
            if planned is not None:
                peak = planned[1]
                out.append({"set": change.sets, "why": change.why, "peak_bytes": peak, "fits": peak <= usable})
                if peak <= usable:
                    return out
        combined, best = {}, self.plan().peak_bytes
        for change in ladder:
            trial = {**combined, **change.sets}
            planned = replan(raw, trial, self.world_size, self.device_type)
            if planned is not None and planned[1] < best:
                combined, best = trial, planned[1]
                out.append({"set": trial, "why": "together: " + change.why, "peak_bytes": best,
                            "fits": best <= usable})
                if best <= usable:
                    return out
        return out

    def activation_changes(self) -> list[MemoryChange]:
        """The rungs that lower the activations' peak, model states and global batch kept, sorted by price
        (`predicted_step_s` against the run as written); a rung that is not a valid run is left out."""
        cfg = self.cfg
        out: list[tuple[dict[str, Any], str]] = []
        if not cfg.memory.loss_chunk:
            from trainers.loss import chunk_tokens  # torch's: a plan that needs no chunk reads without it

            chunk = chunk_tokens(cfg.model.vocab_size, self.device_type)
            out.append(({"memory.loss_chunk": chunk}, f"chunk the output projection and loss, {chunk} tokens a "
                         f"chunk (no tokens x vocab logits)"))
        mb = cfg.train.micro_batch_size
        for smaller in (mb // d for d in (2, 4, 8, 16, 32) if mb // d >= 1 and mb % d == 0):
            out.append(({"train.micro_batch_size": smaller}, f"micro-batch {mb} -> {smaller} (more accumulation; "
                         f"same global batch)"))
        if cfg.memory.activation_checkpointing == "off":
            out.append(({"memory.activation_checkpointing": "selective"}, "selective activation checkpointing "
                         "(recompute norms, SwiGLU and RoPE; keep the matmuls' outputs)"))
        if cfg.memory.ac_every != 1:
            out.append(({"memory.activation_checkpointing": "every"}, "activation checkpointing on every block"))
        raw = json.loads(cfg.model_dump_json())
        base = predicted_step_s(cfg, self.world_size, self.device_type)
        priced = []
        for sets, why in out:
            try:
                cost = predicted_step_s(_changed(raw, sets), self.world_size, self.device_type) / base - 1
            except ConfigError:
                continue
            priced.append(MemoryChange(sets, why, cost, activations=True))
        return sorted(priced, key=lambda c: c.cost)

    def sharding_changes(self) -> list[MemoryChange]:
        """Shard the model states further: a higher ZeRO stage, FSDP instead of DDP, gradients accumulated in
        the shards."""
        par, train, out = self.cfg.parallel, self.cfg.train, []
        if par.engine == "fsdp" and par.stage == 2:
            out.append(MemoryChange({"parallel.zero_stage": 3}, "raise the ZeRO stage: FSDP reshards parameters "
                                    "after forward"))
        if par.engine == "deepspeed" and par.stage < 3:
            out += [MemoryChange({"parallel.zero_stage": s}, f"raise the ZeRO stage to {s}")
                    for s in range(par.stage + 1, 4)]
        if par.engine == "ddp" and par.pp == 1:
            out.append(MemoryChange({"parallel.engine": "fsdp", "parallel.zero_stage": 3},
                                    "shard the model states: FSDP (ZeRO-3) instead of DDP"))
        dp = self.lay.dp
        whole = train.global_batch_size // dp if train.global_batch_size % dp == 0 else 0
        if par.engine == "fsdp" and par.pp == 1 and whole > train.micro_batch_size and not par.sharded_accumulation:
            # grad_accumulation=unsharded keeps a whole fp32 gradient between micro-batches (4 bytes per parameter)
            out.append(MemoryChange({"parallel.grad_accumulation": "sharded"}, "accumulate gradients in the shards "
                                    "(a reduce-scatter per micro-batch)"))
        return out

    def critical_path_changes(self, gpus_per_node: int) -> list[MemoryChange]:
        """Split the model over more ranks (tensor parallelism inside a node, more pipeline stages) or move its
        states to the host."""
        par, world_size, out = self.cfg.parallel, self.world_size, []
        if par.engine == "fsdp":
            for more in (par.tp * 2, par.tp * 4, par.tp * 8):  # a tp group sits inside a node: tp divides them
                if gpus_per_node % more == 0 and world_size % (par.pp * more) == 0:
                    was = f" instead of {par.tp}" if par.tp > 1 else ""
                    out.append(MemoryChange({"parallel.tp": more}, f"tensor parallelism over {more} GPUs of a node"
                                            f"{was} (activation collectives in every block, on the node's links)"))
            for more in (par.pp * 2, par.pp * 4):
                if world_size % more == 0:
                    out.append(MemoryChange({"parallel.pp": more}, f"{more} pipeline stages instead of {par.pp}"))
            if par.offload == "none":
                out.append(MemoryChange({"parallel.offload": "all"},
                                        "FSDP CPU offload of parameters, gradients and optimizer"))
        if par.engine == "deepspeed" and par.offload == "none":
            out.append(MemoryChange({"parallel.offload": "optimizer"}, "DeepSpeed CPU offload of the optimizer"))
        return out
# -------------------------------------------------------------------------------------- step time


@dataclass(frozen=True)
class DeviceSpeed:
    """What the step-time model assumes of a device: rough, but the same for every plan it compares, so
    that the ranking, not the seconds, is what it gets right."""

    flops: float  # 16-bit matmul FLOP/s reached at large matmuls (an H100: ~400 of its 989 TFLOP/s)
    fp32_share: float  # fp32 matmuls' rate over 16-bit (TF32 on CUDA; on a CPU with avx512_bf16 about 0.55)
    bandwidth: float  # bytes/s of memory
    half_tokens: int  # tokens per micro-batch at which matmuls run at half that rate (small matmuls)
    launch_s: float  # host time per kernel launch (eager: per op)


SPEEDS = {"cuda": DeviceSpeed(400e12, 0.5, 2.5e12, 1024, 8e-6), "cpu": DeviceSpeed(2e11, 0.55, 2e10, 32, 5e-6)}
_OPS_PER_BLOCK = 40  # kernels per block forward in eager (norms, casts, RoPE, SwiGLU, adds); x3 with backward


def predicted_step_s(cfg: RunConfig, world_size: int, device_type: DeviceType = "cuda") -> float:
    """A step's time on one rank, from the planner's counts: matmul FLOPs at a rate that falls for small
    micro-batches, checkpointing's recomputation, the bytes the saved activations and the loss move, and the
    kernel launches. Used to rank plans that fit (`memory.fit: auto`), not to promise seconds."""
    sp, model, lay = SPEEDS[device_type], cfg.model, ParallelLayout.of(cfg, world_size)
    seq, mb = cfg.data.seq_len, lay.microbatch_size
    tokens = mb * seq  # per micro-batch
    n_micro = lay.microbatches if lay.pp > 1 else lay.accumulation
    w = widths(cfg)
    rate = sp.flops * (1.0 if w.compute == 2 else sp.fp32_share) * tokens / (tokens + sp.half_tokens)
    head = 6 * model.vocab_size * model.dim  # per token, forward and backward
    per_token = flops_per_token(model, seq) / lay.tp
    blocks_fwd = (per_token - head / lay.tp) / 3
    every = cfg.memory.ac_every
    share = (len(range(0, model.n_layers, every)) / model.n_layers) if every else 0.0
    flops = tokens * (per_token + share * blocks_fwd)
    compiled = cfg.train.compile and device_type == "cuda"
    saved = sum((compiled_block_bytes if compiled else block_activation_bytes)(model, b, tokens, w, seq, lay.tp)
                for b in range(model.n_layers)) / max(lay.pp, 1)
    moved = 3 * saved  # written in forward, read in backward, their gradients written
    if cfg.memory.ac_selective:
        moved += 2 * saved  # the pointwise ops recomputed: read and written once more
    vocab = _vocab_share(model, lay.tp)
    if compiled_loss(cfg, lay, device_type):  # fused: the logits read in forward, read and d(logits) written
        moved += 3 * tokens * vocab * w.compute
    else:
        moved += 6 * tokens * vocab * 4  # the loss's passes over fp32 logits (whole or chunk by chunk)
    launches = 3 * _OPS_PER_BLOCK * model.n_layers / max(lay.pp, 1) * (0.25 if cfg.train.compile else 1.0)
    if cfg.memory.loss_chunk:
        chunks = math.ceil(tokens / cfg.memory.loss_chunk)
        moved += chunks * 10 * vocab * model.dim  # grad_w += (16-bit product): read and write fp32, read it
        launches += chunks * 20
    per_micro = flops / rate + moved / sp.bandwidth + launches * sp.launch_s
    return n_micro * per_micro
