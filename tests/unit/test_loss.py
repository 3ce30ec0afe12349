"""The chunked loss (trainers/loss.py): the same loss and gradients as the whole-logits loss (fp32, 1e-6),
through the model for dense and MoE, and no tensor of tokens x vocab is ever made."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainers.loss import chunked_lm_loss, lm_loss
from trainers.metrics import allocator_peak_bytes
from trainers.models import ModelConfig, MoEConfig, build_model

TOL = 1e-6


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active (forward and backward alike)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunk", [7, 16, 64, 1000])
def test_chunked_loss_and_gradients_equal_the_whole_loss(chunk):
    torch.manual_seed(0)
    n, d, v = 64, 24, 301
    h = torch.randn(n, d, requires_grad=True)
    w = (0.2 * torch.randn(v, d)).requires_grad_()
    t = torch.randint(0, v, (n,))
    whole = lm_loss((h @ w.t())[None], t[None])
    whole.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    chunked = chunked_lm_loss(h, w, t, chunk)
    (2.0 * chunked).backward()  # a scale after the loss reaches the saved gradients
    assert chunked.item() == pytest.approx(whole.item(), rel=TOL)
    assert _rel(h.grad, 2 * gh) <= TOL and _rel(w.grad, 2 * gw) <= TOL


@pytest.mark.parametrize("autocast", [False, True])
def test_a_head_padded_to_aligned_rows_gives_the_same_loss_and_gradients(monkeypatch, autocast):
    """On CUDA the chunked loss pads the head to a multiple of VOCAB_ALIGN rows (16-bit matmuls with odd rows
    take slow kernels): the padding's logits stay out of the softmax and its gradient rows are dropped, so
    the loss and both gradients are those of the unpadded head (fp32 1e-6; bf16: same roundings, 1e-3), in
    the weight's shape. Padding is forced here on the CPU."""
    from trainers import loss as loss_mod

    torch.manual_seed(0)
    n, d, v = 64, 24, 301
    h0, w0, t = torch.randn(n, d), 0.2 * torch.randn(v, d), torch.randint(0, v, (n,))
    runs = []
    for pad in (False, True):
        if pad:
            monkeypatch.setattr(loss_mod, "_vocab_padding", lambda vocab, device_type: -vocab % 64)
            assert loss_mod._vocab_padding(v, "cpu") == 19
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = chunked_lm_loss(h, w, t, 16)
        loss.backward()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            evaluated = chunked_lm_loss(h, w, t, 16)
        runs.append((float(loss), float(evaluated), h.grad, w.grad))
    (loss, evaluated, gh, gw), (loss_p, evaluated_p, gh_p, gw_p) = runs
    tol = 1e-3 if autocast else TOL
    assert gw_p.shape == w0.shape and gh_p.shape == h0.shape
    assert loss_p == pytest.approx(loss, rel=tol) and evaluated_p == pytest.approx(evaluated, rel=tol)
    assert _rel(gh_p, gh) <= tol and _rel(gw_p, gw) <= tol


def test_evaluation_needs_no_gradients():
    h, w, t = torch.randn(10, 8), torch.randn(50, 8, requires_grad=True), torch.randint(0, 50, (10,))
    with torch.no_grad():
        loss = chunked_lm_loss(h, w, t, 3)
    assert float(loss) == pytest.approx(float(lm_loss((h @ w.t())[None], t[None])), rel=TOL)


MODELS = {
    "dense": ModelConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=32),
    "dense-tied": ModelConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=32, tie_embeddings=True),
    "moe": ModelConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2, max_seq_len=32, moe=MoEConfig(num_experts=4)),
}


@pytest.mark.parametrize("name", MODELS)
def test_model_loss_chunked_equals_whole_with_every_gradient(name):
    cfg = MODELS[name]
    tokens = torch.randint(0, cfg.vocab_size, (4, 32))
    targets = torch.randint(0, cfg.vocab_size, (4, 32))
    runs = []
    for chunk in (0, 40):
        torch.manual_seed(0)
        model = build_model(cfg, loss_chunk=chunk)
        with LargestTensor() as seen:
            loss = model(tokens, targets)
            loss.backward()
        runs.append((float(loss), {n: p.grad for n, p in model.named_parameters()}, seen.largest))
    (whole, whole_grads, whole_largest), (chunked, grads, largest) = runs
    assert chunked == pytest.approx(whole, rel=TOL)
    for n, g in whole_grads.items():
        assert _rel(grads[n], g) <= TOL, n
    logits = tokens.numel() * cfg.vocab_size
    assert whole_largest >= logits  # the whole loss makes the logits (so the census can see them) ...
    assert largest < logits  # ... the chunked one never does
    # the largest left: a chunk of logits, the head, or the FFN's activation (MoE's grouped path holds all
    # top-k assignments' rows at once)
    assignments = tokens.numel() * (cfg.moe.top_k if cfg.moe is not None else 1)
    assert largest <= max(40 * cfg.vocab_size, cfg.vocab_size * cfg.dim, assignments * cfg.hidden_dim)


# ------------------------------------------------------------------ selective activation checkpointing


def test_selective_checkpointing_keeps_gradients_and_sits_between_off_and_every():
    """Selective AC recomputes only the cheap ops: the same gradients as no AC, bit for bit, and a peak of
    live tensors between no AC and full AC on every block (the census bench/measure.py uses)."""
    from trainers.metrics import LiveTensorBytes
    from trainers.parallel.ac import apply_activation_checkpointing

    cfg = ModelConfig(vocab_size=257, dim=64, n_layers=3, n_heads=4, max_seq_len=128)
    tokens, targets = torch.randint(0, 257, (4, 128)), torch.randint(0, 257, (4, 128))
    peaks, grads = {}, {}
    for mode in ("off", "selective", "every"):
        torch.manual_seed(0)
        model = build_model(cfg)
        wrapped = apply_activation_checkpointing(model, 1 if mode == "every" else 0, mode == "selective")
        assert wrapped == (0 if mode == "off" else cfg.n_layers)
        with LiveTensorBytes() as live:
            model(tokens, targets).backward()
        peaks[mode] = live.peak
        grads[mode] = {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}
    for mode in ("selective", "every"):
        assert all(torch.equal(grads[mode][n], g) for n, g in grads["off"].items()), mode
    assert peaks["every"] < peaks["selective"] < peaks["off"], peaks


# ------------------------------------------------------------------ 16-bit: the whole loss's numerics


class MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matmul whose operands or output have `vocab` in their shape."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.seen = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)] + [tuple(out.shape)]
            if any(self.vocab in s for s in shapes):
                self.seen.append(tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.dim() == 2))
        return out


@pytest.mark.parametrize("chunk", [16, 1000])
def test_under_bf16_autocast_the_chunks_multiply_in_bf16_and_match_the_whole_loss(chunk):
    """As the whole loss under autocast: logits from a bf16 matmul, softmax in fp32; the same value and
    gradients within bf16's rounding, and no vocabulary-sized matmul in fp32 (a GPU's tensor cores)."""
    torch.manual_seed(0)
    n, d, v = 64, 32, 301
    h = torch.randn(n, d, requires_grad=True)
    w = (0.2 * torch.randn(v, d)).requires_grad_()
    t = torch.randint(0, v, (n,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = lm_loss((h @ w.t())[None], t[None])
    whole.backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulDtypes(v) as seen:
        chunked = chunked_lm_loss(h, w, t, chunk)
        chunked.backward()
    assert chunked.dtype == torch.float32 and chunked.item() == pytest.approx(whole.item(), rel=1e-3)
    assert h.grad.dtype == w.grad.dtype == torch.float32
    assert _rel(h.grad, gh) <= 1e-2 and _rel(w.grad, gw) <= 1e-2
    assert seen.seen and all(set(dtypes) == {"torch.bfloat16"} for dtypes in seen.seen), seen.seen


def test_16bit_weights_without_autocast_multiply_in_their_dtype():
    """FSDP's param_dtype=bf16 runs the head on bf16 weights with autocast off: the chunks do too."""
    h = torch.randn(20, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(50, 8, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 50, (20,))
    whole = lm_loss((h @ w.t())[None], t[None])
    with MatmulDtypes(50) as seen:
        chunked = chunked_lm_loss(h, w, t, 7)
        chunked.backward()
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-3)
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert all(set(dtypes) == {"torch.bfloat16"} for dtypes in seen.seen)


def test_a_failing_compile_falls_back_to_the_same_eager_math():
    from trainers import loss

    def broken(*args):
        raise RuntimeError("no triton here")

    guarded = loss._GuardedCompile(loss._chunk_step, "the chunked loss")
    guarded.compiled = broken
    h, w, t = torch.randn(5, 4), torch.randn(9, 4), torch.randint(0, 9, (5,))
    scale = torch.tensor(0.2)
    with pytest.warns(UserWarning, match="runs eager"):
        got, grad = guarded(h, w, t, scale, True)
    want, want_grad = loss._chunk_step(h, w, t, scale, True)
    assert guarded.compiled is None and torch.equal(got, want) and torch.equal(grad, want_grad)


def test_out_of_memory_in_the_compiled_chunk_is_raised_not_taken_for_a_compile_failure():
    from trainers import loss

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    guarded = loss._GuardedCompile(loss._chunk_step, "the chunked loss")
    guarded.compiled = out_of_memory
    h, w, t = torch.randn(5, 4), torch.randn(9, 4), torch.randint(0, 9, (5,))
    with pytest.raises(torch.OutOfMemoryError):
        guarded(h, w, t, torch.tensor(0.2), True)
    assert guarded.compiled is out_of_memory  # still compiled: the next chunk tries again


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True])
def test_compiled_chunks_several_a_call_equal_eager_and_compile_once_per_shape(monkeypatch, autocast):
    """The CUDA form of the chunked loss, run here by inductor on the CPU: `_chunk_group_traced` compiled, 3
    chunks a call (`_runner`; evaluation a chunk a call), over a padded head, with a last call of fewer,
    shorter chunks. The loss and both gradients are the eager loop's (fp32: 1e-5; bf16 autocast: 1e-3), in
    training and evaluation; each call's d(hidden) lands in its slice; one graph serves every full call."""
    from torch._dynamo.utils import counters

    from trainers import loss as loss_mod

    torch._dynamo.reset()
    counters.clear()
    loss_mod._COMPILED.pop("chunks", None)
    torch.manual_seed(0)
    n, d, v, chunk = 100, 16, 301, 8  # 4 calls of 3 chunks, then one of a chunk and a half
    h0, w0, t = torch.randn(n, d), 0.2 * torch.randn(v, d), torch.randint(0, v, (n,))
    monkeypatch.setattr(loss_mod, "_vocab_padding", lambda vocab, device_type: -vocab % 64)
    monkeypatch.setattr(loss_mod, "CHUNKS_PER_CALL", 3)
    runs = []
    for compiled in (False, True):
        monkeypatch.setattr(loss_mod, "_compiles", lambda device: compiled)  # noqa: B023
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".* runs eager: torch.compile failed")  # no fallback
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = chunked_lm_loss(h, w, t, chunk)
            loss.backward()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                evaluated = chunked_lm_loss(h, w, t, chunk)
        runs.append((loss.item(), evaluated.item(), h.grad, w.grad))
    (loss, evaluated, gh, gw), (loss_c, evaluated_c, gh_c, gw_c) = runs
    tol = 1e-3 if autocast else 1e-5
    assert loss_mod._COMPILED["chunks"].compiled is not None
    assert loss_c == pytest.approx(loss, rel=tol) and evaluated_c == pytest.approx(evaluated, rel=tol)
    assert _rel(gh_c, gh) <= tol and _rel(gw_c, gw) <= tol
    # training: 3 chunks a call and the last call's 1.5; evaluation: a chunk a call and the last half chunk
    assert counters["stats"]["unique_graphs"] == 4


@pytest.mark.slow
def test_a_compiled_call_of_8_chunks_keeps_about_one_chunk_of_logits_alive(monkeypatch):
    """Inductor (here on the CPU; the same scheduler as CUDA's) given 8 chunks in one graph would make every
    chunk's logits first and sum the head's gradient at the end; the chunks' op and its token keep them in
    order: 8 chunks a call peak within one chunk's 16-bit logits of a chunk a call (bf16 autocast; padded
    head; the compile must not fall back to eager). Measured by the allocator's events, the second run of
    each (compiled by then)."""
    from trainers import loss as loss_mod

    monkeypatch.setattr(loss_mod, "_COMPILED", {})
    monkeypatch.setattr(loss_mod, "_compiles", lambda device: True)
    monkeypatch.setattr(loss_mod, "_vocab_padding", lambda vocab, device_type: -vocab % 64)
    torch.manual_seed(0)
    n, d, v, chunk = 512, 32, 4000, 64
    h = torch.randn(n, d, requires_grad=True)
    w = (0.2 * torch.randn(v, d)).requires_grad_()
    t = torch.randint(0, v, (n,))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            chunked_lm_loss(h, w, t, chunk)  # forward: the chunks' work is all here

    peaks = {}
    for calls in (1, 8):
        monkeypatch.setattr(loss_mod, "CHUNKS_PER_CALL", calls)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".* runs eager: torch.compile failed")  # no fallback
            step()
            peaks[calls] = allocator_peak_bytes(step)
    one_chunk = chunk * 4032 * 2
    assert peaks[8] <= peaks[1] + 1.1 * one_chunk, (peaks, one_chunk)  # (measured: + 1.002 chunks)
