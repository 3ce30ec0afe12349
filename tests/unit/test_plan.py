"""The memory planner (trainers/plan.py): its arithmetic on hand-computed cases, its activation formula
against what autograd really saves, one real training step's peak, and the `raytrain plan` command.
(Its predictions for 2-process FSDP runs are checked by bench/plan_vs_measured.py.)"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from raytrain_ext.cli import main
from trainers.config import ConfigError, parse_config
from trainers.layout import ParallelLayout
from trainers.models import param_count
from trainers.models.llama import TransformerBlock, rope_cos_sin
from trainers.plan import (
    Widths,
    _in_flight,
    block_activation_bytes,
    parse_bytes,
    plan_memory,
    plan_run,
    widths,
)
from trainers.sections.model import ModelConfig, MoEConfig

ROOT = Path(__file__).resolve().parents[2]
FP32, AUTOCAST_BF16, BF16 = Widths(4, 4, 4, False), Widths(2, 4, 4, True), Widths(2, 2, 2, False)


def run_config(**sections: dict[str, Any]) -> Any:
    raw: dict[str, Any] = {
        "model": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
        "data": {"path": "not-read-by-the-planner", "seq_len": 32},
        "train": {"global_batch_size": 32, "micro_batch_size": 4, "steps": 10},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return parse_config(raw)


# ------------------------------------------------------------------------------------------ sizes


def test_parse_bytes_units():
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("40GB") == 40 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5e3") == 1500
    with pytest.raises(ConfigError, match="80Gx"):
        parse_bytes("80Gx")


@pytest.mark.parametrize("size", ["0", "0GiB", "-1", "-2GiB", "0.5", "1e-4KB", "1e400", "nan", 0, -1, math.inf])
def test_parse_bytes_refuses_what_is_not_a_size(size):
    with pytest.raises(ConfigError) as e:
        parse_bytes(size, "--device-memory")
    line = str(e.value)
    assert line.startswith(f"--device-memory {size!r} ") and "fix: write e.g. 80GiB" in line and "\n" not in line


# ------------------------------------------------------------------------------------ activations


def test_dense_block_activations_by_hand():
    # dim h=32, 2 heads (a), kv = heads, ffn f = 32 * ceil(int(8 * 32 / 3) / 32) = 96; 4 x 32 tokens
    cfg = ModelConfig(vocab_size=257, dim=32, n_heads=2, max_seq_len=32)
    assert cfg.hidden_dim == 96
    per_token_fp32 = 4 * (8 * 32 + 2 * 32 + 4 * 96 + 2 + 2)  # 4 * (8h + 2hkv + 4f + 2 rsqrt + a lse)
    assert block_activation_bytes(cfg, 0, 128, FP32) == 128 * per_token_fp32
    # autocast: norms in fp32 (4 * (4h + 2)); in bf16 each projection's own cast of its input (3 for q k v,
    # 2 for gate up), q k v and SDPA output, 4f; lse fp32 (4a); a bf16 copy of each weight; RoPE casts 4*s*hd*2
    block_params = 4 * 32 * 32 + 3 * 32 * 96  # matmul weights (the norms' are not cast)
    per_token = 4 * (4 * 32 + 2) + 2 * (3 * 32 + 4 * 32 + 2 * 32 + 4 * 96) + 4 * 2
    expected = 128 * per_token + 2 * block_params + 4 * 32 * 16 * 2
    assert block_activation_bytes(cfg, 0, 128, AUTOCAST_BF16, seq_len=32) == expected


def _saved_bytes(cfg: ModelConfig, x: torch.Tensor, autocast: torch.dtype | None = None, half: bool = False) -> int:
    """Bytes of the distinct storages autograd saves in one block's forward (weights and the RoPE tables,
    which are model buffers, excluded)."""
    torch.manual_seed(0)
    block = TransformerBlock(cfg, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    block = block.bfloat16() if half else block
    cos, sin = rope_cos_sin(cfg.head_dim, x.shape[1], cfg.rope_theta)
    excluded = {t.untyped_storage().data_ptr() for t in (*block.parameters(), cos, sin)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            block(x, cos, sin)
    return sum(seen.values())


# name -> (model fields, widths, autocast dtype, bf16 weights, relative tolerance)
SAVED_CASES: dict[str, tuple[dict[str, Any], Widths, torch.dtype | None, bool, float]] = {
    "fp32": ({}, FP32, None, False, 0.0),  # exact: every saved tensor is in the formula
    "fp32-gqa": ({"n_kv_heads": 2}, FP32, None, False, 0.0),
    "bf16-autocast": ({}, AUTOCAST_BF16, torch.bfloat16, False, 0.0),
    "bf16-weights": ({}, BF16, None, True, 0.0),  # FSDP's bf16 params: all bf16 but the fp32 norms
    "moe-top2": ({"moe": MoEConfig(num_experts=4, top_k=2)}, FP32, None, False, 1e-4),  # + E expert fractions
    "moe-top1": ({"moe": MoEConfig(num_experts=4, top_k=1)}, FP32, None, False, 1e-4),
    # the grouped path's static shapes: every assignment's row, dropped or not; one cast of them under autocast
    "moe-top1-capacity": ({"moe": MoEConfig(num_experts=4, top_k=1, capacity_factor=1.0)}, FP32, None, False, 1e-4),
    # under autocast ~500 bytes of the router (of 1.1 MB) are not in the formula, for both paths alike
    "moe-top2-autocast": ({"moe": MoEConfig(num_experts=4, top_k=2)}, AUTOCAST_BF16, torch.bfloat16, False, 1e-3),
    "moe-top2-loop-autocast": ({"moe": MoEConfig(num_experts=4, top_k=2, impl="loop")}, AUTOCAST_BF16, torch.bfloat16,
                               False, 1e-3),
}


def _case_model(name: str) -> ModelConfig:
    return ModelConfig(vocab_size=257, dim=64, n_heads=4, max_seq_len=32, **SAVED_CASES[name][0])


def saved_bytes_of_all_cases() -> dict[str, int]:
    """Run in a fresh interpreter by the fixture below."""
    out = {}
    for name, (_, _, autocast, half, _) in SAVED_CASES.items():
        x = torch.randn(4, 32, 64, dtype=torch.bfloat16 if half else torch.float32, requires_grad=True)
        out[name] = _saved_bytes(_case_model(name), x, autocast, half)
    return out


@pytest.fixture(scope="module")
def saved_bytes() -> dict[str, int]:
    """Measured in a fresh interpreter: in a full `make test` session, state left by an earlier test made
    autocast keep no bf16 weight copies here (the same test passes alone)."""
    code = "import json; from tests.unit.test_plan import saved_bytes_of_all_cases as f; print(json.dumps(f()))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(SAVED_CASES))
def test_block_activations_match_what_autograd_saves(saved_bytes, name):
    _, w, _, _, rel = SAVED_CASES[name]
    planned = block_activation_bytes(_case_model(name), 0, 4 * 32, w, seq_len=32)
    assert planned == pytest.approx(saved_bytes[name], rel=rel, abs=0 if rel == 0 else None)


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_capacity_factor_keeps_fewer_assignments(impl):
    # 128 tokens, top-2 of 4 experts: capacity = ceil(128 * 2 / 4 * cf); kept per token = min(2, 4 * C / 128)
    moe = {"num_experts": 4, "top_k": 2, "impl": impl}
    plans = {cf: plan_memory(run_config(model={"moe": {**moe, "capacity_factor": cf}},
                                        train={"micro_batch_size": 4}), 1, "cpu") for cf in (None, 1.0, 0.5)}
    assert [plans[cf].moe["kept_assignments_per_token"] for cf in (None, 1.0, 0.5)] == [2.0, 2.0, 1.0]
    per_block = {cf: plans[cf].activations["per_block_bytes"]["0"] for cf in plans}
    if impl == "loop":  # the loop runs the kept rows
        assert per_block[0.5] < per_block[1.0] == per_block[None]
    else:  # static shapes: every assignment's row, and with a capacity a bool per row (2 per token)
        tokens = plans[None].activations["micro_batch_tokens"]
        assert per_block[0.5] == per_block[1.0] == per_block[None] + 2 * tokens


# ----------------------------------------------------------------------------------- model states


def test_fsdp_model_states_are_sharded_by_hand():
    cfg = run_config(parallel={"engine": "fsdp", "zero_stage": 3})
    p = param_count(cfg.model)
    states = plan_memory(cfg, 4, "cpu").model_states
    shard = math.ceil(p / 4)
    assert (states["parameters"], states["gradients"], states["optimizer"]) == (4 * shard, 4 * shard, 8 * shard)


def test_fsdp_gradients_between_micro_batches_follow_grad_accumulation():
    """global 32 / (micro 4 x 4 ranks) = 2 micro-batches. Sharded: the last micro-batch's backward adds
    the head's unsharded gradient (FSDP2 reduces the root last) to the shards; unsharded: whole fp32."""
    plans = {mode: plan_memory(run_config(parallel={"engine": "fsdp", "zero_stage": 3, "grad_accumulation": mode}),
                               4, "cpu") for mode in ("sharded", "unsharded")}
    p, head = param_count(run_config().model), 257 * 32 + 32  # output head and final norm
    assert plans["unsharded"].breakdown["gradients"] == 4 * p
    shards = plans["sharded"].model_states["gradients"]  # ~4P/4 (dim 0 of each tensor padded to 4)
    assert 4 * p / 4 <= shards < 1.01 * 4 * p / 4
    assert plans["sharded"].breakdown["gradients"] == shards + 4 * head
    assert plans["sharded"].peak_bytes < plans["unsharded"].peak_bytes


@pytest.mark.parametrize("stage, persistent, at_step", [(2, (2, 14), (2, 18)), (3, (0, 16), (0, 20))])
def test_deepspeed_bf16_model_states_follow_zero(stage, persistent, at_step):
    """ZeRO paper (bytes/param, N ranks): stage 2 = 2 + (2 + 12)/N, stage 3 = 16/N; the optimizer step
    adds the fp32 gradient partition (DeepSpeed's estimator: stage 2 = 2 + 18/N)."""
    cfg = run_config(parallel={"engine": "deepspeed", "zero_stage": stage, "deepspeed_extra": {
        "zero_optimization": {"stage3_param_persistence_threshold": 0}}}, precision={"dtype": "bf16"})
    p, n = param_count(cfg.model), 8
    states = plan_memory(cfg, n).model_states
    total = states["parameters"] + states["gradients"] + states["optimizer"]
    assert total == pytest.approx(persistent[0] * p + persistent[1] * p / n, rel=1e-3)
    assert total + states["optimizer_step_temporaries"] == pytest.approx(at_step[0] * p + at_step[1] * p / n,
                                                                         rel=1e-3)


@pytest.mark.parametrize("model", [{}, {"moe": {"num_experts": 4, "top_k": 2}, "n_kv_heads": 1},
                                   {"tie_embeddings": True}])
def test_parameter_list_matches_the_built_model(model):
    from trainers.models import build_model
    from trainers.models.flops import param_shapes

    cfg = run_config(model=model).model
    built = {name: tuple(p.shape) for name, p in build_model(cfg).named_parameters()}
    assert {s.name: s.shape for s in param_shapes(cfg)} == built


def test_deepspeed_stage3_keeps_small_parameters_whole():
    """stage3_param_persistence_threshold (1e5 elements): smaller parameters stay whole on every rank, next to
    their partition. Here (dim 32) every tensor but the embedding and head (257 x 32 = 8224 < 1e5, also
    small) is small: all of them. With the threshold at 0 none is."""
    cfg = run_config(parallel={"engine": "deepspeed", "zero_stage": 3})
    p = param_count(cfg.model)
    assert plan_memory(cfg, 4).model_states["parameters"] == 4 * math.ceil(p / 4) + 4 * p
    none = run_config(parallel={"engine": "deepspeed", "zero_stage": 3, "deepspeed_extra": {
        "zero_optimization": {"stage3_param_persistence_threshold": 0}}})
    assert plan_memory(none, 4).model_states["parameters"] == 4 * math.ceil(p / 4)


def test_offload_moves_states_to_the_host():
    fsdp = plan_memory(run_config(parallel={"engine": "fsdp", "offload": "all"}), 2)
    assert fsdp.model_states["parameters"] == fsdp.model_states["optimizer"] == 0
    assert set(fsdp.host_bytes) == {"parameters", "gradients", "optimizer"}
    ds = plan_memory(run_config(parallel={"engine": "deepspeed", "zero_stage": 2, "offload": "optimizer"}), 2)
    assert ds.model_states["optimizer"] == 0 and ds.host_bytes["optimizer"] > 0


def test_expert_parallel_keeps_one_ep_share_of_the_experts():
    moe = {"moe": {"num_experts": 8, "top_k": 2}}
    whole = plan_memory(run_config(model=moe, parallel={"engine": "fsdp"}), 4)
    split = plan_memory(run_config(model=moe, parallel={"engine": "fsdp", "ep": 4}), 4)
    assert split.moe["experts_per_rank"] == 2 and whole.moe["experts_per_rank"] == 8
    assert split.moe["expert_parameters_on_rank"] == whole.moe["expert_parameters"] // 4


# -------------------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize(
    "schedule, v, expected",
    [
        ("1f1b", 1, 4.0),  # rank 0 holds p = 4 micro-batches (Narayanan et al. 2021)
        ("gpipe", 1, 8.0),  # every micro-batch
        ("interleaved_1f1b", 2, 4 * (1 + 3 / 8)),  # Korthikanti et al.: p * (1 + (p - 1) / (p * v))
    ],
)
def test_in_flight_microbatches_of_pipeline_rank_0(schedule, v, expected):
    cfg = run_config(model={"n_layers": 8}, parallel={"engine": "fsdp", "pp": 4, "pipeline_schedule": schedule,
                                                      "virtual_stages": v, "n_microbatches": 8},
                     train={"global_batch_size": 16, "micro_batch_size": 2})
    lay = ParallelLayout.of(cfg, 4)
    assert (lay.dp, lay.microbatches, lay.microbatch_size) == (1, 8, 2)
    assert _in_flight(lay, 0) == pytest.approx(expected)
    assert plan_memory(cfg, 4).peak_bytes > 0


def test_bad_degrees_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"parallel.pp=2 does not divide the world size 3"):
        plan_memory(run_config(parallel={"engine": "fsdp", "pp": 2}), 3)
    with pytest.raises(ConfigError, match="global_batch_size=32 is not a multiple"):
        plan_memory(run_config(parallel={"engine": "fsdp"}), 16)  # 4 x 16 per step > 32


# --------------------------------------------------------------------------- verdict and changes


def test_checkpointing_keeps_only_block_inputs():
    off = plan_memory(run_config(model={"n_layers": 6}), 1, "cpu")
    on = plan_memory(run_config(model={"n_layers": 6}, memory={"activation_checkpointing": "every"}), 1, "cpu")
    assert on.activations["checkpointed_blocks"] == 6 and off.activations["checkpointed_blocks"] == 0
    assert on.activations["checkpointed_block_bytes"] == 4 * 32 * 32 * 4  # micro 4 x seq 32 x dim 32, fp32
    assert on.breakdown["activations"] < off.breakdown["activations"] / 2


def test_a_run_that_does_not_fit_gets_the_cheapest_change_that_does():
    cfg = run_config(model={"n_layers": 6}, parallel={"engine": "fsdp", "zero_stage": 2})
    peak = plan_memory(cfg, 2, "cpu").peak_bytes  # a CPU: no fixed CUDA workspaces at this tiny size
    result = plan_run(cfg, 2, device_memory=int(peak * 0.9), device_type="cpu")  # usable = 81% of today's peak
    assert not result.fits and result.change is not None
    assert result.change["peak_bytes"] <= result.usable_bytes
    # the candidates were tried cheapest first, and all before the chosen one do not fit
    assert result.candidates[-1] == result.change
    assert not any(c["fits"] for c in result.candidates[:-1])
    assert plan_run(cfg, 2, device_memory=peak * 2, device_type="cpu").fits


# ----------------------------------------------------------------------------- real run and CLI


def test_single_process_peak_matches_a_real_step(tiny_config):
    """One real training step of the tiny model, tracked by bench/measure.py's live-tensor tracker."""
    sys.path.insert(0, str(ROOT / "bench"))
    from measure import LiveTensorBytes, training_state

    from trainers.trainer import Trainer, TrainerCallback

    cfg = tiny_config("plan", train={"steps": 3, "eval_every": 0, "micro_batch_size": 8},
                      schedule={"warmup_steps": 1}, checkpoint={"every": 0, "resume": "none"})
    peaks: list[int] = []

    class Track(TrainerCallback):
        tracker = LiveTensorBytes()

        def after_step(self, trainer, record):
            if trainer.step == 2:
                self.tracker.register(training_state(trainer.model, trainer.engine.optimizer))
                self.tracker.__enter__()
            elif trainer.step == 3:
                self.tracker.__exit__(None, None, None)
                peaks.append(self.tracker.peak)

    Trainer(cfg, callbacks=[Track()], progress=False).fit()
    assert plan_memory(cfg, 1, "cpu").peak_bytes == pytest.approx(peaks[0], rel=0.15)


def test_cli_plan_json_and_text(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(json.dumps({"model": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2,
                                         "max_seq_len": 32},
                               "data": {"path": "x", "seq_len": 32},
                               "parallel": {"engine": "fsdp"},
                               "train": {"global_batch_size": 8, "micro_batch_size": 4}}))
    assert main(["plan", str(run), "--world-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["layout"]["dp"] == 2
    assert sum(out["breakdown"].values()) == out["peak_bytes"]
    # (CUDA, the CLI's default: 64 MiB of cuBLAS workspaces come first, so a tiny model needs ~66 MiB)
    assert main(["plan", str(run), "--world-size", "2", "--device-memory", "72.5MiB"]) == 1  # does not fit
    text = capsys.readouterr().out
    assert "does NOT fit" in text and "--set " in text
    assert main(["plan", str(run), "--world-size", "2", "--device-memory", "lots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lots" in err[0]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["plan", "RUN", "--world-size", "2", "--device-memory", "0"], "--device-memory '0' "),
        (["plan", "RUN", "--world-size", "2", "--device-memory=-4GiB"], "--device-memory '-4GiB' "),
        (["plan", "RUN", "--world-size", "0"], "--world-size 0 "),
        (["cluster", "check", str(ROOT / "clusters" / "local.yaml"), "--run", "RUN", "--device-memory", "0GB"],
         "--device-memory '0GB' "),
    ],
    ids=["zero", "negative", "world-size-0", "cluster-check-zero"],
)
def test_cli_refuses_a_degenerate_size_in_one_line(argv, named, tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(json.dumps({"model": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2,
                                         "max_seq_len": 32}, "data": {"path": "x", "seq_len": 32}}))
    assert main([str(run) if a == "RUN" else a for a in argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"raytrain: error: {named}") and "fix:" in err[0], err
    assert "verdict" not in captured.out


def test_widths_per_engine_and_dtype():
    assert widths(run_config()) == FP32
    assert widths(run_config(precision={"dtype": "bf16"})) == AUTOCAST_BF16
    assert widths(run_config(precision={"dtype": "bf16"}, parallel={"engine": "fsdp"})) == BF16
    assert widths(run_config(precision={"dtype": "fp16"}, parallel={"engine": "fsdp"})) == AUTOCAST_BF16


# ---------------------------------------------------------------------------- tensor parallelism


def test_tensor_parallel_model_states_by_hand():
    """tp=2 x dp=1 (dim 32, 2 heads, ffn 96, vocab 257): q/k/v/o and gate/up/down halve, the embedding and the
    head keep ceil(257 / 2) = 129 vocabulary rows (torch.chunk's first share), norms stay whole."""
    cfg = run_config(parallel={"engine": "fsdp", "tp": 2}, train={"global_batch_size": 8})
    block = 2 * 32 + (4 * 32 * 32 + 3 * 32 * 96) // 2
    local = 129 * 32 + 2 * block + 32 + 129 * 32
    states = plan_memory(cfg, 2, "cpu").model_states
    assert (states["parameters"], states["gradients"], states["optimizer"]) == (4 * local, 4 * local, 8 * local)
    # tp=2 x dp=2: FSDP2 shards each rank's tp share over dp
    assert plan_memory(cfg, 4, "cpu").model_states["parameters"] == 4 * math.ceil(local / 2)


def test_tensor_parallel_block_activations_by_hand():
    """Korthikanti et al.'s t-fold split, except the two all-gathered block inputs torch's DTensor saves whole:
    per token (fp32) norms 4 * (4h + 2) on half the sequence; q, k, v, SDPA output and SwiGLU hidden halved;
    the attention and MLP inputs (h each) whole."""
    cfg = ModelConfig(vocab_size=257, dim=32, n_heads=2, max_seq_len=32)
    tokens, h, f = 128, 32, 96
    whole = 4 * (h + h)  # qkv input, MLP input
    split = 4 * (4 * h // 2 + 2 // 2 + 4 * f // 2)  # q k v o-input, logsumexp (1 head), SwiGLU
    norms = 4 * (4 * h + 2) * tokens // 2
    assert block_activation_bytes(cfg, 0, tokens, FP32, seq_len=32, tp=2) == tokens * (whole + split) + norms
    one = block_activation_bytes(cfg, 0, tokens, FP32, seq_len=32)
    assert one / 2 < block_activation_bytes(cfg, 0, tokens, FP32, seq_len=32, tp=2) < one


def test_tensor_parallel_plan_divides_what_it_should():
    moe = {"moe": {"num_experts": 4, "top_k": 2}}
    one = plan_memory(run_config(model=moe, parallel={"engine": "fsdp"}, train={"global_batch_size": 4}), 1, "cpu")
    two = plan_memory(run_config(model=moe, parallel={"engine": "fsdp", "tp": 2}, train={"global_batch_size": 4}),
                      2, "cpu")
    assert two.layout["tp"] == 2 and two.layout["dp"] == 1
    assert two.moe["expert_parameters_on_rank"] == one.moe["expert_parameters_on_rank"] // 2
    assert two.activations["residual_stream_tokens"] == one.activations["residual_stream_tokens"] // 2
    # the logits are the rank's vocabulary share: 129 of 257 columns
    assert two.activations["loss_and_head_bytes"] < 0.6 * one.activations["loss_and_head_bytes"]
    assert any("tensor parallelism over 2 ranks" in a for a in two.assumptions)


def test_tensor_parallelism_is_suggested_when_the_node_allows():
    # micro-batch 1 and every block checkpointed already: the next change is tensor parallelism
    cfg = run_config(model={"n_layers": 6, "n_heads": 4}, parallel={"engine": "fsdp"},
                     memory={"activation_checkpointing": "every"}, train={"micro_batch_size": 1})
    peak = plan_memory(cfg, 4, "cpu").peak_bytes
    with_tp = plan_memory(cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"tp": 2})}), 4, "cpu")
    assert with_tp.peak_bytes < peak
    memory = int((with_tp.peak_bytes + peak) / 2 / 0.9)  # usable between the two
    result = plan_run(cfg, 4, device_memory=memory, device_type="cpu")
    assert result.change is not None and result.change["set"] == {"parallel.tp": 2}, result.candidates
    assert "tensor parallelism over 2 GPUs of a node" in result.change["why"]
    # a 1-GPU node cannot hold a tp group: not suggested
    alone = plan_run(cfg, 4, device_memory=memory, device_type="cpu", gpus_per_node=1)
    assert not any("parallel.tp" in c["set"] for c in alone.candidates)


def test_cli_plan_names_the_tensor_parallel_degree(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(json.dumps({"model": {"vocab_size": 257, "dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
                               "data": {"path": "x", "seq_len": 32}, "parallel": {"engine": "fsdp", "tp": 2},
                               "train": {"global_batch_size": 8, "micro_batch_size": 4}}))
    assert main(["plan", str(run), "--world-size", "4"]) == 0
    assert "(pp=1 x dp=2 x tp=2, ep=1)" in capsys.readouterr().out
    assert main(["plan", str(run), "--world-size", "2", "--gpus-per-node", "0"]) == 2
    assert "--gpus-per-node 0 must be at least 1" in capsys.readouterr().err


# name -> (model fields, bf16 parameters)
TP_SAVED_CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "dense": ({}, False),
    "gqa": ({"n_kv_heads": 2}, False),
    "bf16-params": ({}, True),  # FSDP's bf16 parameters: the fp32 RoPE tables are cast for q and k
    "moe-top2": ({"moe": MoEConfig(num_experts=4, top_k=2)}, False),
}


def _tp_case_model(name: str) -> ModelConfig:
    return ModelConfig(vocab_size=257, dim=64, n_heads=4, n_layers=2, max_seq_len=32, **TP_SAVED_CASES[name][0])


def tp_saved_bytes_of_all_cases() -> dict[str, dict[str, int]]:
    """In each of 2 gloo processes (run by the fixture below): the whole model's forward and loss under
    tensor parallelism (trainers/parallel/parallelize.py, loss_parallel), the bytes of the distinct storages
    autograd saves (a DTensor's local shard, a functional collective's result; parameters and buffers
    excluded), and this rank's parameter elements."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from trainers.models import build_model
    from trainers.parallel.distributed import leave_groups
    from trainers.parallel.expert import apply_expert_parallel
    from trainers.parallel.parallelize import apply_tensor_parallel

    def plain(t: torch.Tensor) -> torch.Tensor:  # what holds the storage: a DTensor's shard, a collective's result
        while True:
            inner = getattr(t, "_local_tensor", None)
            inner = inner if inner is not None else getattr(t, "elem", None)
            if not isinstance(inner, torch.Tensor):
                return t
            t = inner

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    out = {}
    for name, (_, half) in TP_SAVED_CASES.items():
        cfg = _tp_case_model(name)
        torch.manual_seed(0)
        model = build_model(cfg)
        if half:
            for p in model.parameters():
                p.data = p.data.bfloat16()
        apply_tensor_parallel(model, mesh)
        if cfg.moe is not None:
            apply_expert_parallel(model, mesh)
        own = {plain(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, own: set[int] = own, seen: dict[int, int] = seen) -> torch.Tensor:
            storage = plain(t).untyped_storage()
            if storage.data_ptr() not in own:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        tokens = torch.randint(0, cfg.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(tokens)
            with loss_parallel():
                F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        out[name] = {"saved": sum(seen.values()), "params": sum(plain(p).numel() for p in model.parameters())}
    del model, mesh, logits
    leave_groups()  # not at interpreter exit, where a gloo group can abort the rank (trainers/parallel/distributed.py)
    return out


@pytest.fixture(scope="module")
def tp_saved_bytes() -> dict[str, dict[str, int]]:
    """Rank 0's numbers (the larger vocabulary share), from 2 fresh gloo processes (~10 s)."""
    code = ("import json, os; from tests.unit.test_plan import tp_saved_bytes_of_all_cases as f; r = f(); "
            "print(json.dumps(r), flush=True) if os.environ['RANK'] == '0' else None")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return json.loads(outs[0][0].strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(TP_SAVED_CASES))
def test_tensor_parallel_activations_match_what_autograd_saves(tp_saved_bytes, name):
    """The blocks, the head and the loss of `plan_memory`'s count, against what autograd saves at tp=2, the
    embedding's masked ids (8 bytes per token) and the loss's scalars in."""
    from trainers.models.flops import param_shapes
    from trainers.plan import _head_saved

    cfg, half = _tp_case_model(name), TP_SAVED_CASES[name][1]
    w, tokens = (BF16 if half else FP32), 4 * 32
    planned = sum(block_activation_bytes(cfg, i, tokens, w, seq_len=32, tp=2) for i in range(cfg.n_layers))
    planned += _head_saved(cfg, tokens, w, tp=2, seq_len=32) + 8 * tokens
    assert planned == pytest.approx(tp_saved_bytes[name]["saved"], rel=1e-3)
    assert sum(s.local_numel(tp=2) for s in param_shapes(cfg)) == tp_saved_bytes[name]["params"]
