"""`train()`: `raytrain train` from Python (a notebook, a script), returning what the run left.

    from raytrain_ext import train

    result = train("examples/tiny-dense.yaml", overrides={"train.steps": 20})
    result.to_dataframe("train").plot(x="step", y="loss")

Ray: a Ray this process already joined (`ray.init(...)`) is used and left running; else the cluster
`address` (else RAY_ADDRESS) names is joined for the run (the cluster goes on after it); else a local Ray
is started for the run and shut down when it ends, on an error too. `raytrain train` calls this function:
the same checks, once, before Ray starts, and the same one-line ConfigError (a ValueError) for bad input.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from raytrain_ext.result import RunResult

if TYPE_CHECKING:
    from trainers.config import RunConfig
    from trainers.trainer import TrainerCallback

__all__ = ["RunResult", "as_set_items", "run_config", "train"]


def train(
    config: RunConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    overrides: Mapping[str, Any] | None = None,
    address: str | None = None,
    no_ray: bool = False,
    progress: bool = True,
    callbacks: Sequence[str | TrainerCallback] = (),
    ray_log_level: str = "WARNING",
) -> RunResult:
    """Train one run and wait for it.

    `config`: a run YAML's path, its mapping, or a RunConfig. `overrides`: dotted keys to Python values,
    applied as the command's `--set KEY=VALUE` ({"train.steps": 20, "optimizer.lr": 1e-3}). `address`: a
    Ray cluster to join (`auto`, `ray://host:10001`). `no_ray`: train in this process, without Ray.
    `callbacks`: TrainerCallback specs built in every worker ("mypkg.hooks:Notify(every=10)"), or TrainerCallbacks
    (picklable: each worker gets a copy).
    `ray_log_level`: of Ray Train's own console lines. On Ray, `launcher.train` starts a local Ray when none
    runs and no address is given, and stops only what it started.
    Raises ConfigError (a ValueError) with one line naming the field and the fix, before anything starts."""
    from trainers._base import ConfigError

    cfg = run_config(config, overrides)
    if no_ray and callbacks:
        raise ConfigError("--callback is built in Ray's workers; fix: drop --no-ray, or the --callback")
    if no_ray:
        from trainers.fault_tolerance import refuse_without_ray

        refuse_without_ray(cfg, "--no-ray")
    if not no_ray:
        from raytrain_ext.run_checks import check_run

        check_run(cfg, callbacks)  # before Ray's imports too: a bad layout is one line at once, not after ~7 s
        from raytrain_ext.launcher import train as train_on_ray

        return train_on_ray(cfg, address=address, progress=progress, callbacks=callbacks, ray_log_level=ray_log_level,
                            checked=True)
    from raytrain_ext.result import summarize
    from trainers.launch import run_local
    from trainers.preflight import check_inputs
    from trainers.storage import check_run_storage

    check_run_storage(cfg)  # a bucket: there, with credentials, writable
    check_inputs(cfg)  # fail before anything starts
    try:
        fit = run_local(cfg, progress=progress)
    except KeyboardInterrupt:  # Ctrl-C: where the same command continues (the Ray path says it too)
        from trainers.resume import continue_hint

        raise KeyboardInterrupt(continue_hint(cfg.out_dir)) from None
    return summarize(fit.run_dir, fit.checkpoint)


def run_config(
    config: RunConfig | Mapping[str, Any] | str | os.PathLike[str], overrides: Mapping[str, Any] | None = None
) -> RunConfig:
    """The validated run config of `train`'s `config` with `overrides` applied."""
    from trainers.config import RunConfig, apply_overrides, load_config, parse_config

    items = as_set_items(overrides or {})
    if isinstance(config, RunConfig):
        return parse_config(apply_overrides(config.model_dump(mode="json"), items)) if items else config
    if isinstance(config, Mapping):
        return parse_config(apply_overrides(dict(config), items))
    if isinstance(config, (str, os.PathLike)):
        return load_config(config, items)
    raise TypeError(f"config: a run YAML's path, a mapping or a RunConfig, not {type(config).__name__}")


def as_set_items(overrides: Mapping[str, Any]) -> list[str]:
    """Dotted keys and Python values as `--set KEY=VALUE` items (the value written as YAML, read back as it)."""
    import yaml

    def text(value: Any) -> str:
        return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()

    return [f"{key}={text(value)}" for key, value in overrides.items()]
