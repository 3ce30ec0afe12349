"""Ray Train glue: run a `trainers.Trainer` on Ray workers. From Python: `train(config) -> RunResult`
(docs/python-api.md); the `raytrain` command line is `raytrain_ext.cli`."""

from raytrain_ext._version import __version__  # noqa: F401  (the distribution, or pyproject.toml)
from raytrain_ext.api import RunResult, train

__all__ = ["RunResult", "train"]
