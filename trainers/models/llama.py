"""The decoder in the Llama form (and the Mixtral form where `cfg.is_moe_layer(i)`); single-device code.

Parameter names follow Hugging Face Llama/Mixtral so export is a rename at most (only the stacked expert
weights need unstacking).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainers.loss import chunked_lm_loss, lm_loss, lm_loss_compiled
from trainers.models.moe import MoE
from trainers.sections.model import ModelConfig

__all__ = ["Attention", "FeedForward", "Transformer", "TransformerBlock", "apply_rotary_emb", "build_model",
           "rope_cos_sin"]

# Projections that write into the residual stream: init std / sqrt(2 * n_layers) (GPT-2), so the
# residual's variance does not grow with depth.
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "experts.w2")


def rope_cos_sin(
    head_dim: int, seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """RoPE tables (seq_len, head_dim) in HF's non-interleaved layout: frequency i rotates the pair of
    dims (i, i + head_dim/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_emb(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, S, heads, head_dim) by position; cos/sin are (S, head_dim) from `rope_cos_sin`."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads (n_kv_heads <= n_heads)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.grouped = cfg.kv_heads != cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        # -1 heads: stays right if tensor parallelism later shards the projections by head
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
        # SDPA wants (B, heads, S, head_dim); enable_gqa shares kv head j with query heads j*g..(j+1)*g-1,
        # the same grouping as HF's repeat_kv.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=self.grouped
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + ffn(norm(.)); the ffn is `mlp` or `block_sparse_moe`."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.input_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # One attribute name per kind (not a shared alias), so each parameter has exactly one FQN.
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg)
        else:
            self.mlp = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        return h + ffn(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """tokens (B, S) -> logits (B, S, vocab); with targets (B, S), the mean next-token loss instead, computed
    `loss_chunk` tokens at a time without the whole logits when `loss_chunk` > 0 (`memory.loss_chunk`).

    A pipeline stage sets `embed_tokens`, `norm` or `lm_head` to None and deletes entries of `layers` (keys
    stay "N", so FQNs stay `layers.N...`): without `embed_tokens` the input is hidden states, without a head
    the output is. A tied head (`embed_tokens.weight`) needs both `embed_tokens` and `norm` in the stage.
    """

    def __init__(self, cfg: ModelConfig, loss_chunk: int = 0):
        super().__init__()
        self.cfg = cfg
        self.loss_chunk = loss_chunk
        self.compile_loss = False  # the whole loss compiled on CUDA (`lm_loss_compiled`; set with train.compile)
        self.embed_tokens: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )
        # Non-persistent: derived from the config, filled by init_weights (so a meta build can fill them).
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, cfg.head_dim), persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, init_std); residual output projections scaled by 1/sqrt(2 * n_layers); norms to 1.
        Also (re)computes the RoPE tables: call after `to_empty()` of a meta-device build."""
        self.init_rope(self.rope_cos.device)
        out_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:
                std = out_std if name.endswith(_OUTPUT_PROJECTIONS) else self.cfg.init_std
                nn.init.normal_(param, 0.0, std)

    def init_rope(self, device: torch.device | str) -> None:
        """New RoPE tables on `device` (for a model whose buffers are still on the meta device)."""
        cfg = self.cfg
        self.rope_cos, self.rope_sin = rope_cos_sin(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device)

    def forward(self, tokens: Tensor, targets: Tensor | None = None) -> Tensor:
        h = self.embed_tokens(tokens) if self.embed_tokens is not None else tokens
        seq = h.shape[1]
        if seq > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        weight = self._head_weight()
        if targets is None or weight is None:  # logits, or a pipeline stage without the head: its hidden states
            return self._output(h, weight)
        if self.loss_chunk:
            return chunked_lm_loss(h, weight, targets, self.loss_chunk)
        return (lm_loss_compiled if self.compile_loss else lm_loss)(self._output(h, weight), targets)

    def _head_weight(self) -> Tensor | None:
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.cfg.tie_embeddings and self.embed_tokens is not None and self.norm is not None:
            return self.embed_tokens.weight
        return None

    def _output(self, h: Tensor, weight: Tensor | None) -> Tensor:
        # Call lm_head as a module (not F.linear on its weight) so hooks put on it from outside (FSDP) run.
        if self.lm_head is not None:
            return self.lm_head(h)
        return h if weight is None else F.linear(h, weight)


def build_model(cfg: ModelConfig, device: torch.device | str | None = None, loss_chunk: int = 0) -> Transformer:
    """Build on `device` (default: torch's default device) and init the weights; "meta" leaves them
    for `model.to_empty(device=...)` then `model.init_weights()`. Seeds nothing: the caller seeds.
    Built on meta first, so that an eager build and a meta build + init_weights give the same model."""
    with torch.device("meta"):
        model = Transformer(cfg, loss_chunk)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
