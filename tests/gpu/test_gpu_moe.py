"""The MoE experts on one CUDA device (`make test-gpu`): the grouped path (torch._grouped_mm, CUTLASS on
sm90/sm100) against the per-expert loop in bf16 at the bench's width, no host sync in an MoE block's forward
and backward (torch's own sync debug mode), and a compiled block that trains like eager and takes a new aux
gradient scale without compiling again; a model of checkpointed MoE blocks compiled as `train.compile` does,
with no graph break. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.gpu.conftest import needs_cuda
from trainers.models import ModelConfig, MoE, MoEConfig
from trainers.models.llama import TransformerBlock
from trainers.models.moe import grouped_mm_native, reset_moe_stats, set_aux_grad_scale

pytestmark = needs_cuda
# bench/moe.py's gpu-moe layer: dim 1024, 8 experts of 2752 (the Mixtral form's ffn at that dim), top-2
DIM, HIDDEN, E = 1024, 2752, 8


def _moe(impl: str, capacity_factor: float | None = None) -> MoE:
    cfg = ModelConfig(dim=DIM, n_heads=8, ffn_dim=HIDDEN,
                      moe=MoEConfig(num_experts=E, top_k=2, capacity_factor=capacity_factor, impl=impl))
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return moe.cuda()


def _step(moe: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = moe(x)
    (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
    got = {"out": out.detach().float(), "x.grad": x.grad}
    got.update({f"{n}.grad": p.grad for n, p in moe.named_parameters()})
    got["tokens_per_expert"] = moe.last_stats["tokens_per_expert"]
    return got


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_grouped_equals_the_loop_in_bf16(capacity_factor):
    if not grouped_mm_native(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch has no native grouped kernel for this GPU")
    x = torch.randn(4096, DIM, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    loop, grouped = (_step(_moe(impl, capacity_factor), x) for impl in ("loop", "grouped"))
    assert torch.equal(grouped["tokens_per_expert"], loop["tokens_per_expert"])  # routing in fp32: the same
    for key in loop:
        if key != "tokens_per_expert":
            rel = float((grouped[key].float() - loop[key].float()).norm() / loop[key].float().norm())
            assert rel < 1e-2, (key, rel)


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_no_host_sync_in_an_moe_block(capacity_factor):
    """torch reports any synchronisation with the host (`set_sync_debug_mode('error')`)."""
    if not grouped_mm_native(torch.device("cuda"), torch.bfloat16):
        pytest.skip("torch has no native grouped kernel for this GPU (its fallback copies the offsets)")
    moe = _moe("grouped", capacity_factor)
    x = torch.randn(2048, DIM, device="cuda", requires_grad=True)
    set_aux_grad_scale(moe, 0.5, torch.device("cuda"))
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = moe(x)
        out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and moe.experts.w1.grad is not None


def test_a_compiled_moe_block_trains_like_eager_and_compiles_once():
    """Inductor on CUDA: output and gradients as eager's within bf16 rounding, and no recompilation across
    steps whose aux gradient scale differs (the trainer sets it per micro-step)."""
    cfg = ModelConfig(dim=512, n_heads=8, max_seq_len=512, moe=MoEConfig(num_experts=E, top_k=2))
    torch.manual_seed(0)
    eager = TransformerBlock(cfg, 0)
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.02)
    eager = eager.cuda()
    block = copy.deepcopy(eager)
    compiled = torch.compile(block)
    x = torch.randn(4, 512, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    rope = torch.randn(512, 64, device="cuda")  # (seq, head_dim)

    def step(module, run, scale):
        reset_moe_stats(module)
        set_aux_grad_scale(module, scale, torch.device("cuda"))
        module.zero_grad()
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = run(xi, rope, rope)
        out.float().square().mean().backward()
        return [out.float(), xi.grad, module.block_sparse_moe.gate.weight.grad, module.block_sparse_moe.experts.w1.grad]

    torch._dynamo.reset()
    try:
        for i, scale in enumerate((1.0, 0.5, 2.0)):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = step(block, compiled, scale)
            want = step(eager, eager, scale)
            for a, b in zip(got, want):
                rel = float((a.float() - b.float()).norm() / b.float().norm())
                assert rel < 3e-2, (i, rel)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("ac", ["selective", "every"])
def test_checkpointed_moe_blocks_compile_to_one_graph(ac, device="cuda"):
    """`train.compile` over activation checkpointing (`parallelize.compile_blocks`, inductor): no graph break
    in an MoE model's blocks (the router's statistics are not replayed in backward), eager's loss within
    bf16 rounding, finite gradients, and each forward counted once in the MoE totals. (Gradients are not
    compared: a bf16 rounding that flips a token's top-2 moves an expert's gradient by percents.)"""
    from torch._dynamo.utils import counters

    from trainers.models import build_model
    from trainers.models.moe import moe_totals
    from trainers.parallel.ac import apply_activation_checkpointing
    from trainers.parallel.parallelize import compile_blocks

    if not grouped_mm_native(torch.device(device), torch.bfloat16):
        pytest.skip("torch has no native grouped kernel for this GPU (the loop breaks the graph by design)")
    cfg = ModelConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=4, max_seq_len=256,
                      moe=MoEConfig(num_experts=E, top_k=2, capacity_factor=1.25))
    tokens = torch.randint(0, 1024, (4, 256), device=device, generator=torch.Generator(device).manual_seed(0))
    runs = []
    torch._dynamo.reset()
    counters.clear()
    try:
        for compiled in (False, True):
            torch.manual_seed(0)
            model = build_model(cfg).to(device)
            apply_activation_checkpointing(model, 0 if ac == "selective" else 1, selective=ac == "selective")
            if compiled:
                compile_blocks(model)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = model(tokens, tokens)
            loss.backward()
            runs.append((float(loss.detach()), [p.grad for p in model.parameters()], moe_totals(model)))
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    (eager_loss, _, eager_totals), (loss, grads, totals) = runs
    assert loss == pytest.approx(eager_loss, rel=1e-2)
    assert all(bool(g.isfinite().all()) for g in grads)
    assert sorted(totals) == sorted(eager_totals) == [0, 1] and all(t[-1] == 1 for t in totals.values())
