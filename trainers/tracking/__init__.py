"""Experiment trackers (MLflow, Weights & Biases) as sinks of the Trainer's metrics log; see `sink.py`.

Rank 0 builds them (`build_sinks`); nothing is imported from `mlflow` or `wandb` until a sink's thread
opens its tracker, so a run without a `tracking:` section never loads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainers._base import flat_keys
from trainers.run_dir import RunDir
from trainers.sections.tracking import MlflowConfig, TrackingConfig, WandbConfig
from trainers.tracking.sink import Tracker, TrackingSink, _read_state

if TYPE_CHECKING:
    from trainers.config import RunConfig

__all__ = ["MlflowConfig", "Tracker", "TrackingConfig", "TrackingSink", "WandbConfig", "build_sinks",
           "send_unsent", "with_trackers"]


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
        trackers.append(MlflowTracker(t.mlflow, cfg.name, run_dir, flat_keys(config), cfg.to_yaml()))
    if t.wandb is not None:
        trackers.append(WandbTracker(t.wandb, cfg.name, run_dir, config, cfg.to_yaml()))
    state = RunDir(run_dir).tracker_state
    return [TrackingSink(tr, state(tr.name), t.flush_every_s, t.close_timeout_s) for tr in trackers]


def send_unsent(run_dir: Path, timeout_s: float = 10.0) -> bool:
    """Send to MLflow what a finished run dir recorded in metrics.jsonl but its tracker did not (its
    rank 0 ended before the sink was done), continuing its tracked run as a resumed attempt would.
    Returns False when the tracker failed (nothing else is tried)."""
    from trainers.config import ConfigError, load_config
    from trainers.metrics import read_metrics

    files = RunDir(run_dir)
    rows = read_metrics(files.metrics)
    steps = [r["step"] for r in rows if r.get("kind") in ("train", "eval")]
    if not steps or int(_read_state(files.tracker_state("mlflow")).get("sent_step", -1)) >= max(steps):
        return True
    try:
        cfg = load_config(files.config)
    except ConfigError:
        return True  # not a run config we can read: not ours to send
    if cfg.tracking.mlflow is None:
        return True
    tracking = cfg.tracking.model_copy(update={"wandb": None, "close_timeout_s": timeout_s})
    (sink,) = build_sinks(cfg.model_copy(update={"tracking": tracking}))
    sink.start(max(steps), rows)
    sink.close("FINISHED" if max(steps) >= cfg.train.steps else "KILLED")
    return sink.sent_step >= max(steps)
