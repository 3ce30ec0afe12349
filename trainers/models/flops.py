"""Parameter and FLOP counts as pure functions of the config (no model is built): the one place that counts
them, for the trainer's MFU, the pipeline's stage balance (`trainers.layout.block_costs`) and the memory
planner (`trainers.plan`: each rank's tensor-/expert-parallel share of every tensor).

`param_shapes` lists every parameter tensor as `trainers/models` builds it, with the dimension that tensor
parallelism (`trainers/parallel/parallelize.py`) and expert parallelism split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainers.sections.model import ModelConfig

__all__ = [
    "ParamShape",
    "active_param_count",
    "attention_params",
    "block_forward_flops",
    "block_params",
    "block_shapes",
    "embed_params",
    "embed_shapes",
    "expert_params",
    "ffn_params",
    "flops_per_token",
    "head_params",
    "head_shapes",
    "param_count",
    "param_shapes",
]


@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor: its name (FQN), shape, and how tensor / expert parallelism split it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None  # split over tp as torch.chunk splits it; None: whole on every tp rank
    ep_dim: int | None = None  # split over ep (the expert dimension of stacked expert weights)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def expert(self) -> bool:
        return self.ep_dim is not None

    def local_numel(self, tp: int = 1, ep: int = 1) -> int:
        """Elements of the largest share one rank holds (torch.chunk: the first chunks are the larger)."""
        shape = list(self.shape)
        for dim, degree in ((self.tp_dim, tp), (self.ep_dim, ep)):
            if dim is not None and degree > 1:
                shape[dim] = math.ceil(shape[dim] / degree)
        return math.prod(shape)


def attention_params(cfg: ModelConfig) -> int:
    """q, k, v and o projections of one block."""
    q_and_o = 2 * cfg.dim * cfg.n_heads * cfg.head_dim
    k_and_v = 2 * cfg.dim * cfg.kv_heads * cfg.head_dim
    return q_and_o + k_and_v


def ffn_params(cfg: ModelConfig, layer_id: int, active: bool = False) -> int:
    """SwiGLU weights of one layer; an MoE layer adds its router and counts top_k experts when `active`."""
    swiglu = 3 * cfg.dim * cfg.hidden_dim
    if not cfg.is_moe_layer(layer_id):
        return swiglu
    experts = cfg.moe.top_k if active else cfg.moe.num_experts
    return cfg.dim * cfg.moe.num_experts + experts * swiglu


def expert_params(cfg: ModelConfig, layer_id: int) -> int:
    """The stacked experts' w1, w2, w3 of an MoE layer (0 for a dense one): what expert parallelism splits."""
    return cfg.moe.num_experts * 3 * cfg.dim * cfg.hidden_dim if cfg.is_moe_layer(layer_id) else 0


def block_params(cfg: ModelConfig, layer_id: int, active: bool = False) -> int:
    """All parameters of block `layer_id`: attention, feed-forward (the router and all experts, or top_k of
    them when `active`), two norms."""
    return attention_params(cfg) + ffn_params(cfg, layer_id, active) + 2 * cfg.dim


def embed_params(cfg: ModelConfig) -> int:
    return cfg.vocab_size * cfg.dim


def head_params(cfg: ModelConfig) -> int:
    """The final norm and the output projection (none of its own with tied embeddings)."""
    return cfg.dim + (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def block_shapes(cfg: ModelConfig, layer_id: int) -> list[ParamShape]:
    h, f, hq, hkv = cfg.dim, cfg.hidden_dim, cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    p = f"layers.{layer_id}."
    out = [
        ParamShape(p + "input_layernorm.weight", (h,)),
        ParamShape(p + "self_attn.q_proj.weight", (hq, h), tp_dim=0),
        ParamShape(p + "self_attn.k_proj.weight", (hkv, h), tp_dim=0),
        ParamShape(p + "self_attn.v_proj.weight", (hkv, h), tp_dim=0),
        ParamShape(p + "self_attn.o_proj.weight", (h, hq), tp_dim=1),
        ParamShape(p + "post_attention_layernorm.weight", (h,)),
    ]
    if cfg.is_moe_layer(layer_id):
        e, m = cfg.moe.num_experts, p + "block_sparse_moe."
        out += [
            ParamShape(m + "gate.weight", (e, h)),  # the router: replicated over tp
            ParamShape(m + "experts.w1", (e, f, h), tp_dim=1, ep_dim=0),
            ParamShape(m + "experts.w3", (e, f, h), tp_dim=1, ep_dim=0),
            ParamShape(m + "experts.w2", (e, h, f), tp_dim=2, ep_dim=0),
        ]
    else:
        out += [
            ParamShape(p + "mlp.gate_proj.weight", (f, h), tp_dim=0),
            ParamShape(p + "mlp.up_proj.weight", (f, h), tp_dim=0),
            ParamShape(p + "mlp.down_proj.weight", (h, f), tp_dim=1),
        ]
    return out


def embed_shapes(cfg: ModelConfig) -> list[ParamShape]:
    return [ParamShape("embed_tokens.weight", (cfg.vocab_size, cfg.dim), tp_dim=0)]


def head_shapes(cfg: ModelConfig) -> list[ParamShape]:
    out = [ParamShape("norm.weight", (cfg.dim,))]
    if not cfg.tie_embeddings:
        out.append(ParamShape("lm_head.weight", (cfg.vocab_size, cfg.dim), tp_dim=0))
    return out


def param_shapes(cfg: ModelConfig) -> list[ParamShape]:
    """Every parameter tensor, as `build_model(cfg).named_parameters()` lists them."""
    blocks = [s for i in range(cfg.n_layers) for s in block_shapes(cfg, i)]
    return embed_shapes(cfg) + blocks + head_shapes(cfg)


def param_count(cfg: ModelConfig) -> int:
    """All parameters; equals `sum(p.numel() for p in build_model(cfg).parameters())`."""
    return sum(s.numel for s in param_shapes(cfg))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a token uses: as `param_count`, but only top_k of num_experts experts per MoE layer."""
    blocks = sum(block_params(cfg, i, active=True) for i in range(cfg.n_layers))
    return embed_params(cfg) + blocks + head_params(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, for MFU: PaLM appendix B, 6 * N + 12 * L * H * Q * T,
    N the matmul parameters a token uses (no embedding lookup; lm_head even when tied; top_k experts + router)
    and H * Q = n_heads * head_dim = dim, T = seq_len (the attention score and value matmuls)."""
    layers = sum(attention_params(cfg) + ffn_params(cfg, i, active=True) for i in range(cfg.n_layers))
    matmul_params = layers + cfg.vocab_size * cfg.dim
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.dim * seq_len


def block_forward_flops(cfg: ModelConfig, layer_id: int, seq_len: int) -> float:
    """The pipeline's weight of block `layer_id` (its stage balance): forward FLOPs per token of the
    feed-forward (2 x its active weights), the attention scores and values (4 x seq x dim), and the attention
    projections at 1 x their weights (not a matmul's 2 x), so that existing stage splits do not move."""
    ffn = 2 * ffn_params(cfg, layer_id, active=True)
    return float(attention_params(cfg) + 4 * seq_len * cfg.dim + ffn)
