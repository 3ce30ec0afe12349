"""The Mixtral-form MoE: dropless and capacity routing, aux losses, and the aux-gradient trick."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  # its import sets TORCHINDUCTOR_CACHE_DIR; do it before conftest's env-leak guard
import torch.nn.functional as F

from trainers.models import ModelConfig, MoE, MoEConfig, build_model, moe_stats, set_aux_grad_scale

DIM, HIDDEN, E, T = 8, 16, 4, 12


def _moe(top_k: int, seed: int = 0, **moe_kwargs: object) -> MoE:
    cfg = ModelConfig(
        dim=DIM, n_heads=2, ffn_dim=HIDDEN, moe=MoEConfig(num_experts=E, top_k=top_k, **moe_kwargs)
    )
    torch.manual_seed(seed)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
    return moe


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(T, DIM, generator=torch.Generator().manual_seed(seed))


def _expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's SwiGLU written out by hand."""
    w1, w3, w2 = moe.experts.w1[e], moe.experts.w3[e], moe.experts.w2[e]
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def _hand_weights(moe: MoE, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if top_k > 1:  # Mixtral renormalises; top-1 keeps the raw probability (Switch)
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def _force_router(moe: MoE, x: torch.Tensor, first: list[int], second: list[int]) -> torch.Tensor:
    """Rewrite the router and dims 0..E-1 of x so token t's first choice is first[t], second is second[t]."""
    x = x.clone()
    x[:, :E] = 0.0
    x[torch.arange(T), first] = 1.0
    x[torch.arange(T), second] = 0.5
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, :E] = 100.0 * torch.eye(E)  # logits 100 (first), 50 (second), 0
    return x


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_each_token_gets_its_top_k_experts(top_k: int) -> None:
    moe, x = _moe(top_k), _x()
    out = moe(x)
    stats = moe.last_stats
    assert stats["tokens_per_expert"].sum() == T * top_k and stats["dropped_fraction"] == 0
    weights, ids = _hand_weights(moe, x, top_k)
    assert torch.equal(stats["tokens_per_expert"], torch.bincount(ids.flatten(), minlength=E))
    for t in range(T):
        expected = sum(weights[t, j] * _expert(moe, int(ids[t, j]), x[t]) for j in range(top_k))
        torch.testing.assert_close(out[t], expected)


def test_moe_keeps_batch_shape_and_runs_under_bf16_autocast() -> None:
    moe, x = _moe(2), _x().view(3, 4, DIM)
    ref = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = moe(x)
    assert low.shape == x.shape
    torch.testing.assert_close(low.float(), ref, atol=0.1, rtol=0.05)


def test_capacity_top1_everything_to_one_expert() -> None:
    moe = _moe(1, capacity_factor=1.0)
    x = _force_router(moe, _x(), first=[2] * T, second=[0] * T)
    out = moe(x)
    capacity = math.ceil(T * 1 / E * 1.0)  # 3
    stats = moe.last_stats
    assert stats["tokens_per_expert"].tolist() == [0, 0, capacity, 0]
    torch.testing.assert_close(stats["dropped_fraction"], torch.tensor((T - capacity) / T))
    weights, _ = _hand_weights(moe, x, 1)
    for t in range(capacity):  # the first tokens in order keep their place
        torch.testing.assert_close(out[t], weights[t, 0] * _expert(moe, 2, x[t]))
    assert (out[capacity:] == 0).all()  # dropped: the residual carries these tokens


def test_capacity_top2_first_choices_beat_second_choices() -> None:
    moe = _moe(2, capacity_factor=1.0)
    half = T // 2
    # Tokens 0..5 choose (0, 1), tokens 6..11 choose (1, 0): each of experts 0, 1 gets 12 assignments,
    # 6 of them first choices, and capacity = ceil(12 * 2 / 4) = 6. Token order alone would keep the
    # second choices of tokens 0..5 on expert 1; priority keeps only first choices.
    x = _force_router(moe, _x(), first=[0] * half + [1] * half, second=[1] * half + [0] * half)
    out = moe(x)
    stats = moe.last_stats
    assert stats["tokens_per_expert"].tolist() == [6, 6, 0, 0]
    torch.testing.assert_close(stats["dropped_fraction"], torch.tensor(0.5))
    weights, ids = _hand_weights(moe, x, 2)
    for t in range(T):
        torch.testing.assert_close(out[t], weights[t, 0] * _expert(moe, int(ids[t, 0]), x[t]))


def test_capacity_large_enough_drops_nothing() -> None:
    moe, x = _moe(2, capacity_factor=float(E)), _x()  # capacity = all assignments
    dropless = copy.deepcopy(moe)
    dropless.cfg = dropless.cfg.model_copy(update={"capacity_factor": None})
    torch.testing.assert_close(moe(x), dropless(x))
    assert moe.last_stats["dropped_fraction"] == 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_is_minimal_for_uniform_router_and_larger_when_skewed(top_k: int) -> None:
    moe, x = _moe(top_k, aux_loss_coef=0.01), _x()
    with torch.no_grad():
        moe.gate.weight.zero_()
    moe(x)
    torch.testing.assert_close(moe.last_stats["aux_loss"], torch.tensor(0.01))
    x = _force_router(moe, x, first=[0] * T, second=[1] * T)
    moe(x)
    assert moe.last_stats["aux_loss"] > 0.01 * 1.5


def test_z_loss_hand_computed() -> None:
    moe, x = _moe(2, z_loss_coef=0.001), _x()
    moe(x)
    logits = x @ moe.gate.weight.T
    expected = 0.001 * torch.log(torch.exp(logits).sum(-1)).pow(2).mean()
    torch.testing.assert_close(moe.last_stats["z_loss"], expected)


def _hand_aux_total(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Switch balance loss + z-loss from the definitions, differentiable, without the module's trick."""
    logits = x @ moe.gate.weight.T
    probs = logits.softmax(-1)
    ids = probs.topk(moe.cfg.top_k, dim=-1).indices
    f = torch.bincount(ids.flatten(), minlength=E).float() / ids.numel()
    balance = moe.cfg.aux_loss_coef * E * (f * probs.mean(0)).sum()
    return balance + moe.cfg.z_loss_coef * torch.logsumexp(logits, -1).pow(2).mean()


def _grads(moe: MoE, x: torch.Tensor, scale: float, add_hand_aux: bool = False) -> list[torch.Tensor]:
    moe = copy.deepcopy(moe)
    moe.aux_grad_scale.fill_(scale)
    task_grad = torch.randn(T, DIM, generator=torch.Generator().manual_seed(7))
    loss = (moe(x) * task_grad).sum()
    if add_hand_aux:
        loss = loss + _hand_aux_total(moe, x)
    loss.backward()
    return [p.grad for p in moe.parameters()]


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_grad_trick_equals_adding_aux_to_the_loss(top_k: int) -> None:
    moe, x = _moe(top_k, aux_loss_coef=0.1, z_loss_coef=0.01), _x()
    trick = _grads(moe, x, scale=1.0)
    reference = _grads(moe, x, scale=0.0, add_hand_aux=True)  # scale 0 turns the trick off
    for a, b in zip(trick, reference):
        torch.testing.assert_close(a, b)
    without = _grads(moe, x, scale=0.0)
    assert (trick[0] - without[0]).abs().max() > 1e-4  # the router did get the aux gradient
    scaled = _grads(moe, x, scale=2.5)
    torch.testing.assert_close(scaled[0] - without[0], 2.5 * (trick[0] - without[0]))


def test_model_stats_and_set_aux_grad_scale() -> None:
    cfg = ModelConfig(
        vocab_size=32,
        dim=16,
        n_layers=4,
        n_heads=2,
        max_seq_len=8,
        moe=MoEConfig(num_experts=4, top_k=2, every=2),
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    assert moe_stats(model) == {}  # nothing routed yet
    model(torch.randint(0, 32, (2, 8)))
    layers = [model.layers["1"].block_sparse_moe, model.layers["3"].block_sparse_moe]
    stats = moe_stats(model)
    assert stats["moe_aux_loss"] == pytest.approx(sum(float(m.last_stats["aux_loss"]) for m in layers))
    assert stats["moe_z_loss"] == pytest.approx(sum(float(m.last_stats["z_loss"]) for m in layers))
    assert stats["moe_dropped_fraction"] == 0
    loads = [m.last_stats["tokens_per_expert"].float() for m in layers]
    assert stats["moe_load_imbalance_max"] == pytest.approx(max(float(t.max() / t.mean()) for t in loads))
    set_aux_grad_scale(model, 0.25)
    assert [float(m.aux_grad_scale) for m in layers] == [0.25, 0.25]
    assert moe_stats(build_model(cfg.model_copy(update={"moe": None}))) == {}
