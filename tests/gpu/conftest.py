"""The gpu tier (`pytest -m gpu`, `make test-gpu`): the same checks as the CPU tiers at real sizes, on one CUDA
device. Every test here is marked `gpu` and skipped where torch sees no CUDA device."""

from __future__ import annotations

import os

import pytest
import torch

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]



if torch.cuda.is_available() and os.getenv("TRITON_CACHE_DIR") is None:
    # Inductor sets TRITON_CACHE_DIR for the process at its first Triton kernel (to this folder): set it before
    # the leak guard's snapshot (tests/conftest.py), as the root conftest does for inductor's own cache folder.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_dir(), "triton", str(torch.cuda.current_device()))
