"""`memory.fit: auto` (trainers/autofit.py): for runs that do not fit a given `memory.device_memory` as written,
the run (`run_local`, before its engine and Trainer) picks micro-batch size, activation checkpointing and loss
chunking that the planner says fit, keeps the global batch, says what it chose in one line, and the step's
measured peak of live tensors stays under the budget; a run that cannot fit stops with one line before it
builds anything. The Trainer takes a final config and plans nothing."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_raw
from trainers.autofit import fit_memory, resolve_fit
from trainers.config import ConfigError, parse_config
from trainers.launch import run_local
from trainers.metrics import LiveTensorBytes, read_metrics
from trainers.plan import USABLE_FRACTION, plan_memory
from trainers.trainer import Trainer, TrainerCallback

SEQ = 128
MODELS = {  # each is too big as written for the budget below, and small enough to train in seconds
    "dense-wide-vocab": {"vocab_size": 8192, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": SEQ},
    "dense-deep": {"vocab_size": 257, "dim": 128, "n_layers": 6, "n_heads": 4, "max_seq_len": SEQ},
    "moe": {"vocab_size": 2048, "dim": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": SEQ,
            "moe": {"num_experts": 4, "top_k": 2}},
}


def _raw(corpus, run_dir, model: dict, **memory) -> dict:
    train = {"steps": 2, "global_batch_size": 16, "micro_batch_size": 16, "eval_every": 0, "eval_batches": 1,
             "tensorboard": False}
    return tiny_raw(corpus, run_dir, model=model, data={"path": str(corpus), "seq_len": SEQ}, train=train,
                    memory=memory, schedule={"name": "constant"}, checkpoint={"every": 0, "resume": "none"})


class StepPeak(TrainerCallback):
    """The live-tensor peak of step 2 (the state between steps registered first)."""

    def __init__(self):
        self.tracker = LiveTensorBytes()
        self.cfg = None  # the config the Trainer ran

    def after_step(self, trainer, record):
        self.cfg = trainer.cfg
        if trainer.step == 1:
            model, opt = trainer.model, trainer.engine.optimizer
            state = [*model.parameters(), *model.buffers()]
            state += [v for s in opt.state.values() for v in s.values() if hasattr(v, "untyped_storage")]
            self.tracker.register(state)
            self.tracker.__enter__()
        elif trainer.step == 2:
            self.tracker.__exit__(None, None, None)


@pytest.mark.parametrize("name", MODELS)
def test_fit_auto_picks_a_run_that_fits_and_its_peak_stays_under_the_budget(name, corpus_dir, tmp_path, capsys):
    written = parse_config(_raw(corpus_dir, tmp_path / "plan", MODELS[name]))
    as_written = plan_memory(written, 1, "cpu").peak_bytes
    budget = int(0.5 * as_written)  # half of what the run needs as written
    fitted = fit_memory(written, 1, "cpu", budget, "test").cfg
    assert plan_memory(fitted, 1, "cpu").peak_bytes <= budget * USABLE_FRACTION < as_written

    raw = _raw(corpus_dir, tmp_path / "run", MODELS[name], fit="auto", device_memory=str(budget))
    peak = StepPeak()
    run_local(parse_config(raw), callbacks=[peak], progress=False)
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert line.startswith("memory.fit=auto: ") and "global batch 16 kept" in line, line
    cfg = peak.cfg
    chosen = lambda c: (c.memory.loss_chunk, c.memory.activation_checkpointing, c.train.micro_batch_size)  # noqa: E731
    assert cfg.train.global_batch_size == 16 and chosen(cfg) == chosen(fitted) != (0, "off", 16)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl", "train")] == [1, 2]
    assert 0 < peak.tracker.peak <= budget, (peak.tracker.peak, budget, line)


def test_the_trainer_takes_a_final_config(corpus_dir, tmp_path):
    """The fit is resolved before the Trainer (the launchers do it); a Trainer given `memory.fit: auto` says
    so in one line instead of planning; the resolved config is final (resolving it again changes nothing)."""
    raw = _raw(corpus_dir, tmp_path / "run", MODELS["dense-deep"], fit="auto", device_memory="1GB")
    with pytest.raises(ConfigError) as e:
        Trainer(parse_config(raw), progress=False)
    assert "\n" not in str(e.value) and "resolve_fit" in str(e.value)
    cfg, choice = resolve_fit(parse_config(raw))
    assert cfg.memory.fit == "off" and choice is not None and "fits as written" in choice.line
    assert resolve_fit(cfg) == (cfg, None)


def test_a_run_that_fits_is_left_as_written(corpus_dir, tmp_path):
    cfg = parse_config(_raw(corpus_dir, tmp_path, MODELS["dense-deep"]))
    choice = fit_memory(cfg, 1, "cpu", 2**40, "test")
    assert choice.cfg is cfg and choice.changes == {} and "fits as written" in choice.line


def test_a_run_that_cannot_fit_says_so_in_one_line(corpus_dir, tmp_path):
    cfg = parse_config(_raw(corpus_dir, tmp_path, MODELS["dense-wide-vocab"]))
    with pytest.raises(ConfigError) as e:
        fit_memory(cfg, 1, "cpu", 2**20, "memory.device_memory")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("memory.fit=auto: ") and "fix: " in msg


def test_a_bad_device_memory_is_refused_with_the_field(corpus_dir, tmp_path):
    with pytest.raises(ConfigError, match="memory.device_memory"):
        parse_config(_raw(corpus_dir, tmp_path, MODELS["dense-deep"], fit="auto", device_memory="lots"))


def test_on_a_gpu_fit_takes_the_fastest_predicted_plan_that_fits():
    """The 1.1B model at global batch 32 asked as one micro-batch on an 80 GiB GPU (planning only): of the plans
    that fit, the one with the least predicted step time (a smaller micro-batch at full speed), not the first
    rung of a memory ladder (the chunked loss, then recomputation); the line says how it chose."""
    from itertools import product

    from trainers.config import apply_overrides
    from trainers.plan import predicted_step_s

    raw = {"name": "x", "run_dir": "unused", "data": {"path": "unused", "seq_len": 2048},
           "model": {"vocab_size": 32000, "dim": 2048, "n_layers": 16, "n_heads": 16, "max_seq_len": 2048},
           "precision": {"dtype": "bf16"}, "optimizer": {"name": "adamw", "fused": True},
           "train": {"steps": 10, "global_batch_size": 32, "micro_batch_size": 32, "compile": True}}
    device = 80 * 2**30
    choice = fit_memory(parse_config(raw), 1, "cuda", device, "H100")
    assert choice.cfg.memory.activation_checkpointing == "off" and choice.cfg.train.micro_batch_size < 32
    assert "the fastest of" in choice.line and "predicted" in choice.line, choice.line
    best = predicted_step_s(choice.cfg, 1, "cuda")
    for mb, ac, chunk in product((32, 16, 8, 4, 2, 1), ("off", "selective", "every"), (0, 4096)):
        trial = parse_config(apply_overrides(raw, [f"train.micro_batch_size={mb}",
                                                   f"memory.activation_checkpointing={ac}", f"memory.loss_chunk={chunk}"]))
        if plan_memory(trial, 1, "cuda").peak_bytes <= device * USABLE_FRACTION:
            assert predicted_step_s(trial, 1, "cuda") >= best, (mb, ac, chunk)


def test_predicted_time_weighs_recomputation_and_small_micro_batches():
    """The step-time model's directions: full checkpointing costs more than selective, which costs more than
    none; four micro-batches of a quarter cost more than one whole; on a GPU chunk 256 costs more than 4096."""
    from trainers.config import apply_overrides
    from trainers.plan import predicted_step_s

    raw = {"name": "x", "run_dir": "unused", "data": {"path": "unused", "seq_len": 1024},
           "model": {"vocab_size": 32000, "dim": 1024, "n_layers": 8, "n_heads": 8, "max_seq_len": 1024},
           "precision": {"dtype": "bf16"}, "train": {"steps": 10, "global_batch_size": 16, "micro_batch_size": 16}}
    t = lambda *sets, device="cuda": predicted_step_s(parse_config(apply_overrides(raw, list(sets))), 1, device)  # noqa: E731
    assert t() < t("memory.activation_checkpointing=selective") < t("memory.activation_checkpointing=every")
    assert t() < t("train.micro_batch_size=4")
    assert t("memory.loss_chunk=4096") < t("memory.loss_chunk=256")
