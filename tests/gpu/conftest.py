"""The gpu tier (`pytest -m gpu`, `make test-gpu`): the same checks as the CPU tiers at real sizes, on one CUDA
device. Every test here is marked `gpu` and skipped where torch sees no CUDA device."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

import pytest
import torch

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@contextlib.contextmanager
def group_of_one() -> Iterator[None]:
    """torchrun's environment for one process and the group `init_from_env` joins from it; both undone after."""
    import torch.distributed as dist

    from trainers.parallel.distributed import init_from_env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert init_from_env()
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
