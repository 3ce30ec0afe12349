"""Private names of DeepSpeed that trainers/ relies on, in one place, each with what it is for. Read from
DeepSpeed 0.19.8 (pyproject's `deepspeed>=0.19.8,<0.20`); tests/unit/test_deepspeed_compat.py fails when one
moves or changes shape. DeepSpeed is optional: nothing here imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

DEEPSPEED_VERSION = "0.19.8"

__all__ = ["DEEPSPEED_VERSION", "loading_universal_checkpoint"]


@contextlib.contextmanager
def loading_universal_checkpoint(engine: Any) -> Iterator[None]:
    """parallel/deepspeed_engine.py: `engine.load_checkpoint` inside the block reads a universal checkpoint
    (ZeRO partitions written at another data-parallel size). deepspeed/runtime/engine.py reads
    `self._config.load_universal_checkpoint` at load time only; a running engine has no public setter."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before
