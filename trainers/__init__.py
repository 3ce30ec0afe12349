"""The sharded PyTorch trainer (no Ray). The public names below load on first use: `import trainers` stays
instant, and `trainers.Trainer` imports torch only when asked for."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainers._base import ConfigError
    from trainers.config import RunConfig, load_config, parse_config
    from trainers.launch import run_local
    from trainers.trainer import FitResult, Trainer, TrainerCallback

# public name -> the module that defines it
_EXPORTS = {
    "ConfigError": "trainers._base",
    "RunConfig": "trainers.config",
    "load_config": "trainers.config",
    "parse_config": "trainers.config",
    "run_local": "trainers.launch",
    "FitResult": "trainers.trainer",
    "Trainer": "trainers.trainer",
    "TrainerCallback": "trainers.trainer",
}

__all__ = [
    "ConfigError",
    "FitResult",
    "RunConfig",
    "Trainer",
    "TrainerCallback",
    "load_config",
    "parse_config",
    "run_local",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:  # a submodule (`from trainers import loss`) is then imported as one
        raise AttributeError(f"module 'trainers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
