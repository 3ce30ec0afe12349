"""The Llama-form decoder: counts, shapes, causality, RoPE, init, precision, and that it can learn."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  # its import sets TORCHINDUCTOR_CACHE_DIR; do it before conftest's env-leak guard
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainers.models import (
    ModelConfig,
    MoEConfig,
    Transformer,
    active_param_count,
    build_model,
    flops_per_token,
    moe_layers,
    param_count,
)
from trainers.models.llama import apply_rotary_emb, rope_cos_sin

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
CONFIGS = {
    "dense": ModelConfig(**TINY),
    "moe_every_2": ModelConfig(**TINY, moe=MoEConfig(num_experts=4, top_k=2, every=2)),
    "tied": ModelConfig(**TINY, tie_embeddings=True),
    "gqa": ModelConfig(**TINY, n_kv_heads=2, ffn_dim=48),
}


def _model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return build_model(cfg)


def _tokens(cfg: ModelConfig, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(
        0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=torch.Generator().manual_seed(seed)
    )


@pytest.mark.parametrize("name", CONFIGS)
def test_param_count_matches_built_model(name: str) -> None:
    cfg = CONFIGS[name]
    model = _model(cfg)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    # Active params: the built count minus the experts a token does not use.
    unused = sum((m.cfg.num_experts - m.cfg.top_k) * m.experts.w1[0].numel() * 3 for m in moe_layers(model))
    assert active_param_count(cfg) == param_count(cfg) - unused
    assert (active_param_count(cfg) < param_count(cfg)) == (cfg.moe is not None)


def test_hf_parameter_names() -> None:
    names = {n for n, _ in _model(CONFIGS["moe_every_2"]).named_parameters()}
    assert {"embed_tokens.weight", "norm.weight", "lm_head.weight"} <= names
    assert "layers.0.mlp.gate_proj.weight" in names and "layers.0.self_attn.k_proj.weight" in names
    assert {f"layers.1.block_sparse_moe.experts.w{i}" for i in (1, 2, 3)} <= names
    assert "layers.1.block_sparse_moe.gate.weight" in names and not any("bias" in n for n in names)


def test_flops_per_token_hand_computed() -> None:
    cfg = ModelConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    attn = 2 * 64 * 64 + 2 * 64 * 32  # q, o: dim x dim; k, v: dim x (2 kv heads * 16) = 12288
    ffn = 3 * 64 * 128  # 24576
    assert flops_per_token(cfg, seq_len=32) == 6 * (2 * (attn + ffn) + 100 * 64) + 12 * 2 * 64 * 32 == 529920
    moe = cfg.model_copy(update={"moe": MoEConfig(num_experts=4, top_k=2)})
    moe_ffn = 64 * 4 + 2 * ffn  # router + 2 of 4 experts
    assert flops_per_token(moe, seq_len=32) == 6 * (2 * (attn + moe_ffn) + 100 * 64) + 12 * 2 * 64 * 32


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_shape_and_causality(name: str) -> None:
    cfg = CONFIGS[name]
    model = _model(cfg).eval()
    tokens = _tokens(cfg)
    logits = model(tokens)
    assert logits.shape == (2, cfg.max_seq_len, cfg.vocab_size) and logits.dtype == torch.float32
    t = 9
    changed = tokens.clone()
    changed[:, t] = (changed[:, t] + 1) % cfg.vocab_size
    other = model(changed)
    torch.testing.assert_close(other[:, :t], logits[:, :t], rtol=0, atol=0)
    assert (other[:, t:] - logits[:, t:]).abs().amax() > 1e-4


def test_rope_is_rotate_half_and_relative() -> None:
    head_dim, theta = 8, 10000.0
    cos, sin = rope_cos_sin(head_dim, 32, theta)
    x = torch.randn(1, 1, 1, head_dim)
    # Hand-computed HF layout at position 5: pair (i, i + 4) rotated by 5 * theta^(-2i/8).
    angle = 5 * theta ** (-torch.arange(0, head_dim, 2) / head_dim)
    x1, x2 = x[..., :4], x[..., 4:]
    expected = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)
    torch.testing.assert_close(apply_rotary_emb(x, cos[5:6], sin[5:6]), expected)
    # q at position m, k at n: the score depends only on m - n.
    q, k = (
        torch.randn(1, 1, 1, head_dim, dtype=torch.float64),
        torch.randn(1, 1, 1, head_dim, dtype=torch.float64),
    )
    cos, sin = cos.double(), sin.double()

    def score(m: int, n: int) -> torch.Tensor:
        return (
            apply_rotary_emb(q, cos[m : m + 1], sin[m : m + 1])
            * apply_rotary_emb(k, cos[n : n + 1], sin[n : n + 1])
        ).sum()

    for shift in (1, 7, 20):
        torch.testing.assert_close(score(3 + shift, 1 + shift), score(3, 1))
    assert (score(3, 1) - score(3, 2)).abs() > 1e-6  # and it does depend on the distance


def test_tied_embeddings_share_storage() -> None:
    model = _model(CONFIGS["tied"])
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    with torch.no_grad():
        model.embed_tokens.weight[3].zero_()
    logits = model(_tokens(CONFIGS["tied"]))
    # Every logit of token id 3 is <h, embed[3]> = 0: the head reads the embedding's storage.
    assert logits[..., 3].abs().max() == 0
    # And trains it: a row never looked up still gets a gradient, through the head alone.
    unused = 5
    tokens = _tokens(CONFIGS["tied"])
    tokens[tokens == unused] = 0
    model(tokens).logsumexp(-1).sum().backward()
    assert model.embed_tokens.weight.grad[unused].abs().sum() > 0


def test_meta_build_then_init_is_finite_and_matches_eager() -> None:
    cfg = CONFIGS["moe_every_2"]
    model = build_model(cfg, device="meta")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    logits = model(_tokens(cfg))
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, _model(cfg, seed=0)(_tokens(cfg)), rtol=0, atol=0)


def test_init_scales() -> None:
    cfg = ModelConfig(vocab_size=256, dim=128, n_layers=8, n_heads=4, moe=MoEConfig(every=2))
    model = _model(cfg)
    out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    assert abs(model.layers["0"].self_attn.q_proj.weight.std() - cfg.init_std) < 1e-3
    assert abs(model.layers["0"].self_attn.o_proj.weight.std() - out_std) < 5e-4
    assert abs(model.layers["0"].mlp.down_proj.weight.std() - out_std) < 5e-4
    assert abs(model.layers["1"].block_sparse_moe.experts.w2.std() - out_std) < 5e-4
    assert (model.layers["1"].post_attention_layernorm.weight == 1).all()


def test_pipeline_stage_passes_hidden_states() -> None:
    cfg = CONFIGS["dense"]
    model = _model(cfg).eval()
    tokens = _tokens(cfg)
    full = model(tokens)
    first, last = _model(cfg).eval(), _model(cfg).eval()
    first.norm, first.lm_head = None, None
    del first.layers["1"]
    last.embed_tokens = None
    del last.layers["0"]
    torch.testing.assert_close(last(first(tokens)), full, rtol=0, atol=0)
    assert {n.split(".")[1] for n, _ in last.named_parameters() if n.startswith("layers.")} == {"1"}


def test_bf16_autocast_close_to_fp32() -> None:
    cfg = CONFIGS["moe_every_2"]
    model = _model(cfg)
    tokens = _tokens(cfg)
    ref = model(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(tokens)
    assert low.dtype == torch.bfloat16
    low.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max() + 0.02


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class _Checkpointed(torch.nn.Module):
    """What activation checkpointing from outside does: recompute the block in backward."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, *args, use_reentrant=False)


def test_activation_checkpointing_and_determinism() -> None:
    cfg = CONFIGS["moe_every_2"]
    tokens = _tokens(cfg)
    grads = []
    for wrap in (False, False, True):
        model = _model(cfg)
        if wrap:
            for name in list(model.layers):
                model.layers[name] = _Checkpointed(model.layers[name])
        _loss(model, tokens).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(grads[0], grads[1]):
        assert torch.equal(a, b)  # deterministic on CPU
    for a, b in zip(grads[0], grads[2]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["dense", "moe_every_2"])
def test_overfits_one_batch(name: str) -> None:
    cfg = CONFIGS[name]
    model = _model(cfg)
    tokens = _tokens(cfg, batch=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = _loss(model, tokens).item()
    for _ in range(50):
        opt.zero_grad()
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
    assert first > 3.5 and loss.item() < 0.3 * first
