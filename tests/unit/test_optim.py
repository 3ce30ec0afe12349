"""Optimizers, weight-decay groups, schedules, and hyperparameters changed on restore."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainers.config import LRScheduleConfig, OptimizerConfig
from trainers.optim import LRSchedule, apply_hparams, build_optimizer, lr_factor, param_groups


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_no_weight_decay_on_norms_biases_embeddings():
    net = _Net()
    decay, no_decay = param_groups(net, 0.1)
    assert {id(p) for p in decay["params"]} == {id(net.lin.weight)}
    assert {id(p) for p in no_decay["params"]} == {
        id(net.emb.weight),
        id(net.lin.bias),
        id(net.norm.weight),
        id(net.norm.bias),
    }
    assert no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rmsprop", "adam", "adamw"])
def test_every_optimizer_reduces_a_quadratic(name):
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    cfg = OptimizerConfig(
        name=name,
        lr=0.3 if name == "adagrad" else 0.05,
        momentum=0.9 if name in ("sgd", "rmsprop") else 0.0,
        nesterov=name == "sgd",
    )
    opt = build_optimizer(net, cfg)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])  # realisable: the minimum loss is 0
    first = None
    for _ in range(50):
        opt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_schedules_shape():
    total = 100
    cos = LRScheduleConfig(name="warmup_cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cos, total) == pytest.approx(0.1)
    assert lr_factor(9, cos, total) == pytest.approx(1.0)
    assert lr_factor(10, cos, total) == pytest.approx(1.0)
    assert lr_factor(55, cos, total) == pytest.approx(0.55)
    assert lr_factor(100, cos, total) == pytest.approx(0.1)
    lin = LRScheduleConfig(name="warmup_linear", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(50, lin, total) == pytest.approx(0.5)
    inv = LRScheduleConfig(name="inverse_sqrt", warmup_steps=4)
    assert lr_factor(15, inv, total) == pytest.approx(math.sqrt(4 / 16))
    exp = LRScheduleConfig(name="exponential", gamma=0.5, step_size=10)
    assert lr_factor(20, exp, total) == pytest.approx(0.25)
    step = LRScheduleConfig(name="step", gamma=0.5, step_size=10)
    assert lr_factor(19, step, total) == pytest.approx(0.5)
    assert lr_factor(37, LRScheduleConfig(name="constant"), total) == 1.0


def test_schedule_is_a_function_of_the_step_and_the_current_base_lr():
    sched_cfg = LRScheduleConfig(name="warmup_cosine", warmup_steps=5)
    opt = build_optimizer(nn.Linear(2, 2), OptimizerConfig(lr=1e-2))
    schedule = LRSchedule(opt.param_groups, sched_cfg, 40)
    assert [schedule.apply(s) for s in range(40)] == [1e-2 * lr_factor(s, sched_cfg, 40) for s in range(40)]
    assert all(g["lr"] == opt.param_groups[0]["lr"] for g in opt.param_groups)


def test_hyperparameters_applied_after_loading_old_optimizer_state():
    net = nn.Linear(2, 2)
    old = build_optimizer(net, OptimizerConfig(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95)))
    net(torch.randn(3, 2)).sum().backward()
    old.step()
    new = build_optimizer(net, OptimizerConfig(lr=5e-3, weight_decay=0.2, betas=(0.8, 0.99)))
    new.load_state_dict(old.state_dict())  # the saved groups carry the old values
    assert new.param_groups[0]["lr"] == 1e-2
    apply_hparams(new, OptimizerConfig(lr=5e-3, weight_decay=0.2, betas=(0.8, 0.99)))
    decay, no_decay = new.param_groups
    assert decay["lr"] == decay["initial_lr"] == 5e-3
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.99)
    assert LRSchedule(new.param_groups, LRScheduleConfig(name="constant"), 10).apply(3) == 5e-3
