"""Parameter and FLOP counts as pure functions of the config (no model is built)."""

from __future__ import annotations

from trainers.models.config import ModelConfig

__all__ = ["active_param_count", "flops_per_token", "param_count"]


def _attention_params(cfg: ModelConfig) -> int:
    q_and_o = 2 * cfg.dim * cfg.n_heads * cfg.head_dim
    k_and_v = 2 * cfg.dim * cfg.kv_heads * cfg.head_dim
    return q_and_o + k_and_v


def _ffn_params(cfg: ModelConfig, layer_id: int, active: bool) -> int:
    """SwiGLU weights of one layer; an MoE layer adds its router and counts top_k experts when `active`."""
    swiglu = 3 * cfg.dim * cfg.hidden_dim
    if not cfg.is_moe_layer(layer_id):
        return swiglu
    experts = cfg.moe.top_k if active else cfg.moe.num_experts
    return cfg.dim * cfg.moe.num_experts + experts * swiglu


def _layer_matmul_params(cfg: ModelConfig, active: bool) -> int:
    return sum(_attention_params(cfg) + _ffn_params(cfg, i, active) for i in range(cfg.n_layers))


def _count(cfg: ModelConfig, active: bool) -> int:
    embedding = cfg.vocab_size * cfg.dim
    lm_head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    return embedding + _layer_matmul_params(cfg, active) + norms + lm_head


def param_count(cfg: ModelConfig) -> int:
    """All parameters; equals `sum(p.numel() for p in build_model(cfg).parameters())`."""
    return _count(cfg, active=False)


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a token uses: as `param_count`, but only top_k of num_experts experts per MoE layer."""
    return _count(cfg, active=True)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token, for MFU.

    PaLM appendix B: 6 * N + 12 * L * H * Q * T, with N the matmul parameters a token uses (embedding
    lookup excluded, lm_head included even when tied: its matmul still runs; top_k experts + router for
    MoE) and H * Q = n_heads * head_dim = dim, T = seq_len (the attention score and value matmuls).
    """
    matmul_params = _layer_matmul_params(cfg, active=True) + cfg.vocab_size * cfg.dim
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.dim * seq_len
