"""The grouped expert path (`model.moe.impl: grouped`) against the per-expert loop: the same routing, drops,
losses, gradients and metrics; no device-to-host sync in an MoE block's forward and backward; no graph
break when compiled. The multi-process layouts (ep, pp, tp) are in tests/dist/test_moe_impls.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo  # noqa: F401  # its import sets TORCHINDUCTOR_CACHE_DIR; do it before conftest's env-leak guard
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from trainers._base import ConfigError
from trainers.config import parse_config
from trainers.models import ModelConfig, MoE, MoEConfig
from trainers.models.llama import TransformerBlock
from trainers.models.moe import combine, dispatch, grouped_mm_native, run_experts

DIM, HIDDEN, E, T = 16, 24, 4, 48
CASES = {  # name: (top_k, capacity_factor); the capacity cases drop assignments (checked below)
    "top1-dropless": (1, None),
    "top2-dropless": (2, None),
    "top1-capacity1.25": (1, 1.25),
    "top2-capacity1.0": (2, 1.0),
}


def _moe(top_k: int, capacity_factor: float | None, impl: str) -> MoE:
    cfg = ModelConfig(dim=DIM, n_heads=2, ffn_dim=HIDDEN,
                      moe=MoEConfig(num_experts=E, top_k=top_k, capacity_factor=capacity_factor, impl=impl))
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.5)
        moe.gate.weight[0] += 1.0  # a skewed router: expert 0 overflows under capacity
    return moe


def _step(moe: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward + backward of a loss that weighs every output element differently; what it produced."""
    x = x.clone().requires_grad_()
    out = moe(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    got = {"out": out.detach(), "x.grad": x.grad}
    got.update({f"{n}.grad": p.grad for n, p in moe.named_parameters()})
    got.update({f"stats.{k}": v for k, v in moe.last_stats.items()})
    got["totals"] = moe.totals
    return got


@pytest.mark.parametrize("name", CASES)
def test_grouped_equals_loop_in_fp32(name: str) -> None:
    """Outputs, input and weight gradients (the aux losses' included), aux/z-losses, loads and the dropped
    fraction: within 1e-5, with the same tokens kept (integer loads equal exactly)."""
    top_k, factor = CASES[name]
    x = torch.randn(T, DIM, generator=torch.Generator().manual_seed(1))
    loop, grouped = (_step(_moe(top_k, factor, impl), x) for impl in ("loop", "grouped"))
    assert (loop["stats.dropped_fraction"] > 0) == (factor is not None)
    assert torch.equal(grouped["stats.tokens_per_expert"], loop["stats.tokens_per_expert"])
    assert sorted(grouped) == sorted(loop)
    for key, ref in loop.items():
        torch.testing.assert_close(grouped[key], ref, rtol=1e-5, atol=1e-6, msg=key)


class _RowAdds(TorchDispatchMode):
    """aten ops that add float rows into a tensor by index (atomics on CUDA, or a sort first)."""

    ADDS = {torch.ops.aten.index_add.default, torch.ops.aten.index_add_.default, torch.ops.aten.scatter_add.default,
            torch.ops.aten.scatter_add_.default, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
            torch.ops.aten._index_put_impl_.default}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ADDS and args[0].is_floating_point():
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", CASES)
def test_dispatch_and_combine_sum_as_indexing_and_index_add_do_without_adding_rows_by_index(name: str) -> None:
    """`dispatch`'s gather and `combine`'s weighted sum give what plain indexing and `index_add` give (output,
    the input's and the router's gradients, fp32 1e-6), and neither forward nor backward adds float rows by
    index (each is a gather both ways)."""
    top_k, factor = CASES[name]
    moe = _moe(top_k, factor, "loop")
    x0 = torch.randn(T, DIM, generator=torch.Generator().manual_seed(1))
    results = []
    for reference in (True, False):
        x = x0.clone().requires_grad_()
        _, _, expert_ids, weights = moe.route(x)
        with _RowAdds() as adds:
            routed, routing = dispatch(x, expert_ids, weights, E, moe.capacity(T))
            if reference:
                routed = x[routing.token_ids]
            expert_out = moe.experts(routed, routing.tokens_per_expert)
            if reference:
                weighted = expert_out * routing.weights[routing.order][:, None]
                out = expert_out.new_zeros(T, DIM).index_add(0, routing.token_ids, weighted)
            else:
                out = combine(expert_out, routing, T)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), x.grad, moe.gate.weight.grad.clone(), adds.seen))
        moe.zero_grad()
    (out_ref, gx_ref, gg_ref, adds_ref), (out, gx, gg, adds) = results
    assert adds_ref and not adds  # the reference does add rows by index: the check sees it
    for got, want in ((out, out_ref), (gx, gx_ref), (gg, gg_ref)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_dispatch_puts_dropped_assignments_last_in_priority_order() -> None:
    """Capacity 2 per expert: the kept rows are sorted by expert, the overflow follows in rank order
    (choice-major, then token), and every assignment appears once."""
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # (T=4, k=2): expert 0 asked for 4 times
    weights = torch.full((4, 2), 0.5)
    x = torch.arange(4.0)[:, None]
    routed, routing = dispatch(x, ids, weights, 4, capacity=2)
    assert routing.tokens_per_expert.tolist() == [2, 2, 1, 1]
    # kept: expert 0 <- tokens 0, 1 (first choices); 1 <- 0, 2; 2 <- 1; 3 <- 3; dropped: expert 0's
    # first choice of token 2, then its second choice of token 3
    assert routing.token_ids.tolist() == [0, 1, 0, 2, 1, 3, 2, 3]
    assert routed[:, 0].tolist() == routing.token_ids.float().tolist()


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_rows_after_the_kept_ones_give_zeros_and_no_gradient(impl: str) -> None:
    torch.manual_seed(0)
    w1, w3, w2 = torch.randn(E, HIDDEN, DIM), torch.randn(E, HIDDEN, DIM), torch.randn(E, DIM, HIDDEN)
    x = torch.randn(10, DIM, requires_grad=True)
    out = run_experts(impl, w1, w2, w3, x, torch.tensor([3, 0, 2, 1]))  # 6 kept rows, 4 dropped (not dropless)
    out.sum().backward()
    assert out[6:].abs().sum() == 0 and x.grad[6:].abs().sum() == 0
    assert out[:6].abs().sum() > 0 and x.grad[:6].abs().sum() > 0


def test_bf16_autocast_grouped_matches_loop() -> None:
    """Under autocast the grouped path casts as F.linear does: same dtype, bf16-close values."""
    x = torch.randn(T, DIM, generator=torch.Generator().manual_seed(1))
    outs = {}
    for impl in ("loop", "grouped"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[impl] = _moe(2, 1.0, impl)(x)
    assert outs["grouped"].dtype == outs["loop"].dtype
    torch.testing.assert_close(outs["grouped"], outs["loop"], atol=2e-2, rtol=2e-2)


def _fake_block_step(impl: str, capacity_factor: float | None) -> None:
    """An MoE block's forward and backward on fake tensors (shapes, no data), bf16 autocast."""
    cfg = ModelConfig(dim=32, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=capacity_factor, impl=impl))
    with FakeTensorMode():
        block = TransformerBlock(cfg, 0)
        x, rope = torch.randn(2, 16, 32, requires_grad=True), torch.randn(16, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = block(x, rope, rope)
        out.float().sum().backward()
        assert block.block_sparse_moe.experts.w1.grad is not None and x.grad is not None


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_no_host_sync_in_an_moe_block_forward_and_backward(capacity_factor: float | None) -> None:
    """Fake tensors hold no data: every op that would copy a value to the host (`.item()`, `.tolist()`,
    `bool()`, a boolean mask's nonzero, bincount, repeat_interleave without a size) raises under
    FakeTensorMode. The grouped path runs through; the loop (which needs its split sizes) cannot."""
    _fake_block_step("grouped", capacity_factor)
    with pytest.raises(torch._subclasses.fake_tensor.DataDependentOutputException):
        _fake_block_step("loop", capacity_factor)


@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_no_graph_break_when_compiled(capacity_factor: float | None) -> None:
    """`torch._dynamo.explain` of an MoE block under bf16 autocast (what `train.compile` compiles): one
    graph with the grouped path; the loop breaks it (its split sizes are host values)."""
    cfg = ModelConfig(dim=32, n_heads=2, max_seq_len=16, moe=MoEConfig(num_experts=4, top_k=2,
                                                                      capacity_factor=capacity_factor))
    torch.manual_seed(0)
    block = TransformerBlock(cfg, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, rope = torch.randn(2, 16, 32), torch.randn(16, 16)
    breaks = {}
    for impl in ("grouped", "loop"):
        block.block_sparse_moe.experts.impl = impl
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            explained = torch._dynamo.explain(block)(x, rope, rope)
        breaks[impl] = explained.graph_break_count
    torch._dynamo.reset()
    assert breaks["grouped"] == 0
    assert breaks["loop"] > 0


_COMPILED_AC = """
import torch
from torch._dynamo.utils import counters
from trainers.models import ModelConfig, MoEConfig, build_model
from trainers.models.moe import moe_totals
from trainers.parallel.ac import apply_activation_checkpointing
from trainers.parallel.parallelize import compile_blocks

cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16,
                  moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0, impl="grouped"))
tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
for ac in ("selective", "every"):  # selective first: torch's warning is logged once a process
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(cfg)
        apply_activation_checkpointing(model, 0 if ac == "selective" else 1, selective=ac == "selective")
        if compiled:
            compile_blocks(model, backend="aot_eager")  # AOT autograd's tracing, as inductor's; no C++ build
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, tokens)
        loss.backward()
        runs.append(([p.grad for p in model.parameters()], moe_totals(model)))
    (eager, eager_totals), (comp, comp_totals) = runs
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(comp, eager)), ac
    assert sorted(comp_totals) == [0, 1] and all(torch.equal(comp_totals[i], eager_totals[i]) for i in (0, 1)), ac
    assert all(t[-1] == 1 for t in comp_totals.values()), ac  # one forward counted, not its recomputation
    assert not counters["graph_break"], (ac, dict(counters["graph_break"]))
print("one graph per block, eager's gradients and totals")
"""


def test_compiled_checkpointed_moe_blocks_trace_whole_and_log_nothing_to_act_on() -> None:
    """`train.compile` with activation checkpointing (selective, then every block) on MoE blocks
    (`parallelize.compile_blocks`): no graph break (the router's statistics are a side effect dynamo traces
    inside a checkpoint only when told not to replay it in backward), eager's gradients and MoE totals (one
    forward counted, not its recomputation), and no "context_fn ... in-place ops" warning from torch (dropped
    in `trainers.parallel.ac`). A fresh interpreter: the warning and the graph-break counters are per process."""
    import subprocess
    import sys
    from pathlib import Path

    from trainers.parallel.ac import SAC_UNDER_COMPILE_WARNING

    proc = subprocess.run([sys.executable, "-c", _COMPILED_AC], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "one graph per block" in proc.stdout, proc.stderr[-3000:]
    assert SAC_UNDER_COMPILE_WARNING not in proc.stderr and "in-place ops" not in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def _inductor_loaded():
    """Inductor sets an environment variable for the process on its first compile: let that happen before
    the leak guard's snapshot (it is not the test's doing)."""
    torch.compile(lambda x: x + 1)(torch.ones(1))


@pytest.mark.slow
def test_compiled_grouped_block_trains_like_eager(_inductor_loaded) -> None:
    """Inductor compiles the grouped path (bf16 autocast, capacity dropping): output and gradients as in
    eager within bf16 rounding, and the MoE totals counted once per forward."""
    cfg = ModelConfig(dim=32, n_heads=2, max_seq_len=16,
                      moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.0, impl="grouped"))
    torch.manual_seed(0)
    eager = TransformerBlock(cfg, 0)
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.1)
    compiled = copy.deepcopy(eager)
    compiled.compile()
    x, rope = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)), torch.randn(16, 16)
    results = []
    for block in (eager, compiled):
        xi = x.clone().requires_grad_()
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = block(xi, rope, rope)
            out.float().square().sum().backward()
        results.append((out.float(), xi.grad, block.block_sparse_moe.experts.w1.grad, block.block_sparse_moe.totals))
    torch._dynamo.reset()
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got.float(), ref.float(), atol=0.05, rtol=0.05)
    assert results[1][3][-1] == 2  # two forwards counted


def test_auto_picks_grouped_where_torch_has_a_kernel() -> None:
    cpu = torch.device("cpu")
    assert grouped_mm_native(cpu, torch.float32) and grouped_mm_native(cpu, torch.bfloat16)
    assert not grouped_mm_native(torch.device("meta"), torch.bfloat16)


def test_a_wrong_impl_names_the_key_and_the_fix(tiny_config) -> None:
    raw = tiny_config("bad").model_dump(mode="json")
    raw["model"]["moe"] = {"impl": "fast"}
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    line = str(err.value)
    assert "\n" not in line and "model.moe.impl='fast'" in line and "'loop'" in line and "fix:" in line


def test_impl_is_not_part_of_a_checkpoint_compatibility(tiny_config) -> None:
    """A run may resume with another impl, and checkpoints saved before the key existed still resume."""
    from trainers.resume import compat_of

    keys = [compat_of(tiny_config(impl, model={"moe": {"impl": impl}}), {}) for impl in ("loop", "grouped")]
    assert keys[0] == keys[1] and not any("impl" in key for key in keys[0])


def test_a_new_aux_grad_scale_is_an_input_of_the_compiled_block_not_a_recompile() -> None:
    """The trainer sets the aux losses' gradient scale before every micro-step (1/accumulation x the loss
    scale, which moves under fp16): a compiled block must take a new value without compiling again, and its
    router gradient must be eager's at that value."""
    from trainers.models.moe import reset_moe_stats, set_aux_grad_scale

    cfg = ModelConfig(dim=32, n_heads=2, max_seq_len=16, moe=MoEConfig(num_experts=4, top_k=2, impl="grouped",
                                                                      aux_loss_coef=0.5, z_loss_coef=0.1))
    torch.manual_seed(0)
    eager = TransformerBlock(cfg, 0)
    for p in eager.parameters():
        torch.nn.init.normal_(p, std=0.1)
    block = copy.deepcopy(eager)
    compiled = torch.compile(block, backend="aot_eager")
    x, rope = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1)), torch.randn(16, 16)

    def gate_grad(module, run, scale):
        reset_moe_stats(module)  # as the trainer's step: its start
        set_aux_grad_scale(module, scale)
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x, rope, rope)
        out.float().sum().backward()
        return module.block_sparse_moe.gate.weight.grad.clone()

    torch._dynamo.reset()
    try:
        for i, scale in enumerate((1.0, 0.0, 4.0, 0.25)):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                got = gate_grad(block, compiled, scale)
            want = gate_grad(eager, eager, scale)
            torch.testing.assert_close(got, want)
            if scale == 4.0:
                assert (got - gate_grad(eager, eager, 1.0)).abs().max() > 1e-3  # the scale does move it
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dim, hidden", [(36, 48), (32, 44)])
def test_auto_takes_the_loop_where_rows_are_not_16_byte_multiples(dim: int, hidden: int) -> None:
    """grouped_mm's kernels need rows in multiples of 16 bytes (8 bf16 values): with a dim or an expert
    hidden size off that, `auto` runs the loop (same math) instead of raising."""
    def moe(impl: str) -> MoE:
        cfg = ModelConfig(dim=dim, n_heads=2, ffn_dim=hidden, moe=MoEConfig(num_experts=E, top_k=2, impl=impl))
        torch.manual_seed(0)
        module = MoE(cfg)
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.5)
        return module

    x = torch.randn(T, dim, generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="16 bytes"), torch.autocast("cpu", dtype=torch.bfloat16):
        moe("grouped")(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, loop = _step(moe("auto"), x), _step(moe("loop"), x)
    for key in loop:
        torch.testing.assert_close(auto[key], loop[key], rtol=0, atol=0, msg=key)
