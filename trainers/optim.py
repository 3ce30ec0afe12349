"""Optimizers and closed-form learning-rate schedules. The hyperparameters are re-applied from the config
after a restore: population-based training changes them between segments of a run.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainers.config import LRScheduleConfig, OptimizerConfig

__all__ = ["LRSchedule", "apply_hparams", "build_optimizer", "lr_factor", "param_groups"]


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: never on norms, biases or embeddings (GPT-2/Llama practice)."""
    embedding_params = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or id(p) in embedding_params else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "decay": True},
        {"params": no_decay, "weight_decay": 0.0, "decay": False},
    ]


# name -> the torch optimizer and the config's keys it takes besides lr and weight_decay. torch's Adam folds
# weight decay into the gradient (L2), unlike AdamW's decoupled decay.
_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], tuple[str, ...]]] = {
    "sgd": (torch.optim.SGD, ("momentum", "nesterov")),
    "adagrad": (torch.optim.Adagrad, ("eps",)),
    "rmsprop": (torch.optim.RMSprop, ("alpha", "eps", "momentum")),
    "adam": (torch.optim.Adam, ("betas", "eps")),
    "adamw": (torch.optim.AdamW, ("betas", "eps")),
}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    groups = [g for g in param_groups(model, cfg.weight_decay) if g["params"]]
    kind, keys = _OPTIMIZERS[cfg.name]
    fused = {"fused": True} if cfg.fused else {}  # the config refuses fused rmsprop
    opt = kind(groups, lr=cfg.lr, **{key: getattr(cfg, key) for key in keys}, **fused)
    apply_hparams(opt, cfg)
    return opt


def apply_hparams(opt: torch.optim.Optimizer, cfg: OptimizerConfig) -> None:
    """Write the config's hyperparameters into every param group (after a restore, too)."""
    for group in opt.param_groups:
        group["initial_lr"] = cfg.lr  # the schedule multiplies this
        group["lr"] = cfg.lr
        group["weight_decay"] = cfg.weight_decay if group.get("decay", True) else 0.0
        for key in _OPTIMIZERS[cfg.name][1]:
            group[key] = getattr(cfg, key)


def lr_factor(step: int, cfg: LRScheduleConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    w = cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "exponential":
        return cfg.gamma ** (step / cfg.step_size)
    if cfg.name == "step":
        return cfg.gamma ** (step // cfg.step_size)
    if step < w:
        return (step + 1) / w
    if cfg.name == "inverse_sqrt":
        return math.sqrt(max(w, 1) / (step + 1)) if step + 1 > max(w, 1) else 1.0
    decay = cfg.decay_steps or max(total_steps - w, 1)
    progress = min((step - w) / decay, 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.name == "warmup_cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


class LRSchedule:
    """Sets `lr = initial_lr * lr_factor(step)` on the param groups before each step. Closed form (no
    state besides the step), and it drives any optimizer with torch-style param groups, DeepSpeed's too."""

    def __init__(self, param_groups: list[dict], cfg: LRScheduleConfig, total_steps: int):
        self.param_groups, self.cfg, self.total_steps = param_groups, cfg, total_steps

    def apply(self, step: int) -> float:
        factor = lr_factor(step, self.cfg, self.total_steps)
        for group in self.param_groups:
            group["lr"] = group["initial_lr"] * factor
        return self.param_groups[0]["lr"]
