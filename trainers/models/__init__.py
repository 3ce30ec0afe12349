"""The Llama-form decoder (Mixtral-form MoE when `ModelConfig.moe` is set), and its counts.

Single-device code: parallelism is applied from outside (see `trainers.parallel`).
"""

from __future__ import annotations

import torch

from trainers.models.config import ModelConfig, MoEConfig
from trainers.models.flops import active_param_count, flops_per_token, param_count
from trainers.models.llama import Transformer
from trainers.models.moe import MoE, moe_layers, moe_stats, set_aux_grad_scale

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


def build_model(cfg: ModelConfig, device: torch.device | str | None = None, loss_chunk: int = 0) -> Transformer:
    """Build on `device` (default: torch's default device) and init the weights; "meta" leaves them
    for `model.to_empty(device=...)` then `model.init_weights()`. Seeds nothing: the caller seeds.
    `loss_chunk`: tokens per chunk of the loss with targets (see `Transformer`); 0 = the whole logits.

    Built on meta first, so the weights depend only on `init_weights` and the RNG state (not on what
    the module constructors draw): an eager build and a meta build + init_weights give the same model.
    """
    with torch.device("meta"):
        model = Transformer(cfg, loss_chunk)
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model
