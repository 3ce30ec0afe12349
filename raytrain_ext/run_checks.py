"""What `raytrain train` checks before Ray starts or is imported: the run's inputs, its resume point, its callbacks,
its per-step fault tolerance and every world size it may take. Nothing here imports torch or Ray (a bad layout
is answered in well under a second, not after Ray Train's imports: 7.6 s on 2 busy cores), and the workers build
their callbacks with the same parser (`load_callback`)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_ext import ray_compat
from trainers._base import ConfigError
from trainers.config import RunConfig
from trainers.fault_tolerance import check_fault_tolerance, group_world_sizes, per_step
from trainers.layout import check_world_sizes
from trainers.preflight import check_inputs
from trainers.resume import check_resume
from trainers.storage import check_run_storage

if TYPE_CHECKING:
    from trainers.trainer import TrainerCallback

__all__ = ["check_replica_groups_on_ray", "check_run", "load_callback"]


def check_run(cfg: RunConfig, callbacks: Sequence[str | TrainerCallback] = ()) -> None:
    """Everything that can be checked before a worker starts: inputs on disk, that the checkpoint it would
    resume from fits this config, that the callbacks import, and that every world size the run may take
    is a valid layout (`trainers.layout.check_world_sizes`, the rules the workers run: engine, pp/tp/ep
    degrees, the global batch = micro x accumulation x dp, the pipeline's microbatches), so a bad one gets
    the workers' own line before any worker starts. A run dir or data in a bucket: that the bucket is there,
    credentials too, and (run dir) an object can be written, first."""
    check_run_storage(cfg)
    check_resume(cfg, check_inputs(cfg))
    for spec in callbacks:
        if isinstance(spec, str):  # a TrainerCallback is already built
            _check_callback(spec)
    check_fault_tolerance(cfg)  # first: a per-step fault-tolerant run's process groups are its replica groups'
    check_world_sizes(cfg, group_world_sizes(cfg.scaling))
    if per_step(cfg.scaling):
        check_replica_groups_on_ray()


def check_replica_groups_on_ray() -> None:
    """Per-step fault tolerance needs a Ray whose Train replaces a lost replica group alone."""
    if not ray_compat.has_torchft_config():
        import ray

        raise ConfigError(
            f"scaling.fault_tolerance=per_step needs Ray Train's torchft replica groups (Ray 2.60 or newer), and "
            f"this is Ray {ray.__version__}; fix: pip install 'ray[train]>=2.60', or scaling.fault_tolerance=none"
        )


def _check_callback(spec: str) -> None:
    """The module of a `--callback` spec must be importable here (the workers import it again)."""
    module = spec.partition("(")[0].partition(":")[0].strip()
    if not module or ":" not in spec:
        load_callback(spec)  # its one-line refusal of the form
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None and not (Path.cwd() / top).exists():
        raise ConfigError(
            f"callback {spec!r}: no module named {top!r}; fix: install it or put it on PYTHONPATH on every node"
        )


def load_callback(spec: str) -> TrainerCallback:
    """`package.module:Name` or `package.module:Name(key=value, ...)` with JSON-like literal values."""
    target, _, args = spec.partition("(")
    module, sep, name = target.partition(":")
    if not sep:
        raise ConfigError(f"callback {spec!r} is not module:Name; fix: e.g. mypkg.hooks:MyCallback")
    try:
        factory = getattr(importlib.import_module(module.strip()), name.strip())
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"callback {spec!r}: {e}; fix: make {module.strip()} importable on every node (installed, or "
            f"on PYTHONPATH) and check the name"
        ) from None
    kwargs: dict[str, Any] = {}
    if args.strip(")").strip():
        call = ast.parse(f"f({args.rstrip(')')})", mode="eval").body
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    return factory(**kwargs)
