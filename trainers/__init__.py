"""The sharded PyTorch trainer (no Ray). The public names below load on first use: `import trainers` stays
instant, and `trainers.Trainer` imports torch only when asked for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainers._lazy import lazy_names

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


__getattr__, __dir__ = lazy_names(globals(), _EXPORTS)
