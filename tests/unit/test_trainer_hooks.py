"""TrainerCallback.on_model_built: the model as built, before the engine wraps it or the optimizer exists."""

from __future__ import annotations

import pytest
import torch

from trainers.trainer import Trainer, TrainerCallback


class _FreezeEmbedding(TrainerCallback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def on_model_built(self, trainer: Trainer, model: torch.nn.Module) -> None:
        # before the engine's setup: the trainer has no model or optimizer yet
        self.seen.append((type(model).__name__, hasattr(trainer, "model")))
        for name, p in model.named_parameters():
            if "embed" in name:
                p.requires_grad_(False)


def _embedding(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "embed" in n}


def test_a_callback_freezes_parameters_before_the_optimizer_takes_them(tiny_config):
    hook = _FreezeEmbedding()
    frozen = Trainer(tiny_config("frozen", train={"steps": 8}), callbacks=[hook], progress=False)
    plain = Trainer(tiny_config("plain", train={"steps": 8}), progress=False)
    assert hook.seen == [("Transformer", False)]  # once, on the bare model
    start = _embedding(frozen.model)
    assert start and all(torch.equal(start[n], p) for n, p in _embedding(plain.model).items())  # same init
    frozen.fit()
    plain.fit()
    optimized = {id(p) for g in frozen.engine.optimizer.param_groups for p in g["params"]}
    assert not any(id(p) in optimized for n, p in frozen.model.named_parameters() if "embed" in n)
    after, moved = _embedding(frozen.model), _embedding(plain.model)
    assert all(torch.equal(after[n], start[n]) for n in start)  # frozen: unchanged by 8 steps
    assert all(not torch.equal(moved[n], start[n]) for n in start)  # trained without the hook


class _DuckTyped:  # hooks by name, without TrainerCallback: on_model_built and after_eval are missing
    def on_fit_start(self, trainer):
        pass

    def after_step(self, trainer, record):
        pass

    def after_checkpoint(self, trainer, path):
        pass


def test_a_callback_without_every_hook_is_refused_in_one_line_naming_them(tiny_config):
    with pytest.raises(TypeError) as err:
        Trainer(tiny_config("duck"), callbacks=[_DuckTyped()], progress=False)
    message = str(err.value)
    assert "\n" not in message and "_DuckTyped" in message and "subclass trainers.TrainerCallback" in message
    assert "on_model_built" in message and "after_eval" in message and "after_step" not in message
