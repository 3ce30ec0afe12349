"""The Llama-form decoder (Mixtral-form MoE when `ModelConfig.moe` is set), and its counts.

Single-device code: parallelism is applied from outside (see `trainers.parallel`). The names below load on
first use, so that a config (`trainers.sections.model`) or a count (`trainers.models.flops`) reads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainers._lazy import lazy_names

if TYPE_CHECKING:
    from trainers.models.flops import active_param_count, flops_per_token, param_count
    from trainers.models.llama import Transformer, build_model
    from trainers.models.moe import MoE, moe_layers, moe_stats, set_aux_grad_scale
    from trainers.sections.model import ModelConfig, MoEConfig

# public name -> the module that defines it
_EXPORTS = {
    "ModelConfig": "trainers.sections.model",
    "MoEConfig": "trainers.sections.model",
    "active_param_count": "trainers.models.flops",
    "flops_per_token": "trainers.models.flops",
    "param_count": "trainers.models.flops",
    "Transformer": "trainers.models.llama",
    "build_model": "trainers.models.llama",
    "MoE": "trainers.models.moe",
    "moe_layers": "trainers.models.moe",
    "moe_stats": "trainers.models.moe",
    "set_aux_grad_scale": "trainers.models.moe",
}

__all__ = [
    "MoE",
    "ModelConfig",
    "MoEConfig",
    "Transformer",
    "active_param_count",
    "build_model",
    "flops_per_token",
    "moe_layers",
    "moe_stats",
    "param_count",
    "set_aux_grad_scale",
]


__getattr__, __dir__ = lazy_names(globals(), _EXPORTS)
