"""Process-group set-up from the environment torchrun (or Ray Train) provides."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["device_for_rank", "init_from_env"]


def init_from_env(timeout_s: float = 600) -> bool:
    """Initialise the default process group when WORLD_SIZE > 1 is in the environment (torchrun, Ray
    Train) and none exists yet. gloo on CPU, nccl on GPU. Returns whether a group is initialised."""
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
