"""The gpu tier (`pytest -m gpu`, `make test-gpu`): the same checks as the CPU tiers at real sizes, on one CUDA
device. Every test here is marked `gpu` and skipped where torch sees no CUDA device."""

from __future__ import annotations

import pytest
import torch

needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


