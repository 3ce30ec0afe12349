"""Mixed precision: fp32, bf16 autocast, fp16 autocast with dynamic loss scaling (torch.amp)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from trainers.config import PrecisionConfig

__all__ = ["Precision", "allow_tf32"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def allow_tf32(on: bool) -> None:
    """fp32 matmuls and cuDNN convolutions on TF32 tensor cores, or not (process-wide). The legacy setters
    only: torch >= 2.9 refuses reads once they and the new `fp32_precision` are mixed; inductor reads them."""
    torch.set_float32_matmul_precision("high" if on else "highest")  # = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = on


class Precision:
    """Autocast context, scaled backward, unscale + clip, and the optimizer step that fp16 may skip."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device):
        self.dtype = _DTYPES[cfg.dtype]
        self.device_type = device.type
        if device.type == "cuda":
            allow_tf32(cfg.tf32)
        self.scaler = (
            torch.amp.GradScaler(device.type, init_scale=cfg.init_scale, growth_interval=cfg.growth_interval)
            if cfg.dtype == "fp16"
            else None
        )

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def clip(
        self, opt: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float | None
    ) -> float:
        """Unscale (fp16) then clip; returns the global grad norm before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        params = [p for p in params if p.grad is not None]
        if max_norm is None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm)

    def step(self, opt: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            opt.step()
        else:  # skips the step when grads overflowed, then adjusts the scale
            self.scaler.step(opt)
            self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
