"""The baseline: a minimal hand-written PyTorch loop, as a person would write one (nanoGPT-style).

It does the same math as `trainers.Trainer` for one process, fp32, no accumulation: the same model and
seed, AdamW with decay on matrices only, warmup + cosine LambdaLR, grad clip, and the same windows in the
same order. Only the numbers are read from the RunConfig; none of the Trainer's machinery is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trainers.config import RunConfig
from trainers.data.dataset import GlobalSampler, TokenWindows
from trainers.models import build_model

__all__ = ["StepHook", "train"]

# Called after each step with (step, loss, model, optimizer): the benchmark's clock and memory probes.
StepHook = Callable[[int, float, nn.Module, torch.optim.Optimizer], None]


def train(
    cfg: RunConfig, data: TokenWindows, after_step: StepHook | None = None, set_to_none: bool = True,
    device: torch.device | str = "cpu",
) -> list[float]:
    """Train `cfg.train.steps` steps on `data`; returns the loss of each step. `set_to_none=False` is the
    seed's naive loop (bench/lean.py): gradients are zeroed, not freed, so they live through the next step.
    `device`: where the model and each batch go (bench/gpu.py: a GPU)."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(device)
    opt = _adamw(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _warmup_cosine(s, cfg))
    sampler = GlobalSampler(data.num_windows, cfg.seed, cfg.data.shuffle)
    batch, losses = cfg.train.global_batch_size, []
    for step in range(cfg.train.steps):
        x, y = (t.to(device) for t in data.get(sampler.window_ids(step * batch, batch)))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())  # logged every step, as any loop does
        if after_step is not None:
            after_step(step + 1, losses[-1], model, opt)
    return losses


def _adamw(model: nn.Module, cfg: RunConfig) -> torch.optim.AdamW:
    # Weight decay on matrices only, not on norms or the embedding (GPT-2/Llama practice).
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith("embed_tokens")]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or n.startswith("embed_tokens")]
    o = cfg.optimizer
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)


def _warmup_cosine(step: int, cfg: RunConfig) -> float:
    warmup, floor = cfg.schedule.warmup_steps, cfg.schedule.min_lr_ratio
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(cfg.train.steps - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
