"""Experiment trackers (MLflow, Weights & Biases) as sinks of the Trainer's metrics log; see `sink.py`.

Rank 0 builds them (`build_sinks`); nothing is imported from `mlflow` or `wandb` until a sink's thread
opens its tracker, so a run without a `tracking:` section never loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainers.tracking.config import MlflowConfig, TrackingConfig, WandbConfig
from trainers.tracking.sink import Tracker, TrackingSink, flatten

if TYPE_CHECKING:
    from trainers.config import RunConfig

__all__ = [
    "MlflowConfig",
    "Tracker",
    "TrackingConfig",
    "TrackingSink",
    "WandbConfig",
    "build_sinks",
    "with_trackers",
]


def with_trackers(cfg: RunConfig, mlflow: str | None = None, wandb: str | None = None) -> RunConfig:
    """`raytrain train --mlflow [URI] --wandb [PROJECT]`: turn a tracker on, keeping what the YAML says
    of it (None: leave it as it is; "": on, with the YAML's or the default settings)."""
    from trainers.config import parse_config

    raw = cfg.model_dump(mode="json")
    tracking = raw["tracking"]
    for name, value, key in (("mlflow", mlflow, "tracking_uri"), ("wandb", wandb, "project")):
        if value is None:
            continue
        tracking[name] = tracking[name] or {}
        if value:
            tracking[name][key] = value
    return parse_config(raw)


def build_sinks(cfg: RunConfig) -> list[TrackingSink]:
    """One sink per tracker the run's `tracking:` section names (none: no sink)."""
    from trainers.tracking.mlflow_tracker import MlflowTracker
    from trainers.tracking.wandb_tracker import WandbTracker

    t, run_dir = cfg.tracking, cfg.out_dir
    config = {k: v for k, v in cfg.model_dump(mode="json").items() if k != "tracking"}
    trackers = []
    if t.mlflow is not None:
        trackers.append(MlflowTracker(t.mlflow, cfg.name, run_dir, flatten(config), cfg.to_yaml()))
    if t.wandb is not None:
        trackers.append(WandbTracker(t.wandb, cfg.name, run_dir, config, cfg.to_yaml()))
    return [
        TrackingSink(tr, run_dir / tr.name / "state.json", t.flush_every_s, t.close_timeout_s)
        for tr in trackers
    ]
