"""The `tracking:` section of a run: where rank 0 also sends its metrics (MLflow, Weights & Biases), a copy
sent from a background thread; `metrics.jsonl` stays the record of truth."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, field_validator

from trainers._base import StrictModel

__all__ = ["MlflowConfig", "TrackingConfig", "WandbConfig"]


class MlflowConfig(StrictModel):
    tracking_uri: str | None = None  # None = a local SQLite store in RUN_DIR/mlflow/ (`mlflow ui` reads it)
    experiment: str | None = None  # None = the run's name
    run_name: str | None = None  # None = the run's name
    # A child of this run (a Tune trial under its experiment's run): one child per run_name, which every
    # Train run of that trial continues.
    parent_run_id: str | None = None
    tags: dict[str, str] = {}

    @field_validator("tracking_uri")
    @classmethod
    def _scheme(cls, uri: str | None) -> str | None:
        if uri is not None and ":" not in uri:
            raise ValueError(
                f"tracking_uri={uri} has no scheme; fix: e.g. http://host:5000, sqlite:///path/mlflow.db, "
                f"databricks, or leave it out for a local store in the run dir"
            )
        return uri


class WandbConfig(StrictModel):
    project: str = "raytrain"
    mode: Literal["online", "offline", "disabled"] | None = None  # None = W&B's own (WANDB_MODE, else online)
    entity: str | None = None
    group: str | None = None  # runs shown together (a Tune experiment's trials share their experiment's)


class TrackingConfig(StrictModel):
    mlflow: MlflowConfig | None = None
    wandb: WandbConfig | None = None
    flush_every_s: PositiveFloat = 5.0  # the background thread sends what accumulated this often
    # At the end of a run, how long to wait for a slow or unreachable server before leaving the rest
    # unsent (metrics.jsonl holds it all).
    close_timeout_s: float = Field(30.0, ge=0)
