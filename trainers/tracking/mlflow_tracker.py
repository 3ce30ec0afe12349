"""MLflow through its own client (`mlflow-skinny`): the resolved config as params, each train/eval record as
metrics at its step, events as tags, `config.yaml` and the final checkpoint's path as artifacts.

With no `tracking_uri` the store is a SQLite file in the run dir (`mlflow ui --backend-store-uri
sqlite:///RUN_DIR/mlflow/mlflow.db` shows it), artifacts beside it; MLflow 3 refuses its old file store.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trainers.run_dir import RunDir
from trainers.sections.tracking import MlflowConfig
from trainers.tracking.sink import Tracker, metric_values

__all__ = ["MlflowTracker", "local_store"]

# MLflow's limits per log_batch call, and on a param's or tag's value.
_METRICS_PER_CALL, _PARAMS_PER_CALL, _TAGS_PER_CALL, _VALUE_CHARS = 1000, 100, 100, 5000
# Keys that differ between the Train runs of one tracked run by design (not a changed hyperparameter).
_PER_ATTEMPT = ("name", "run_dir", "checkpoint.resume")


def local_store(folder: Path) -> tuple[str, str]:
    """(tracking URI, artifact location) of a SQLite store in `folder`."""
    folder = Path(folder).resolve()
    return f"sqlite:///{folder / 'mlflow.db'}", (folder / "artifacts").as_uri()


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(
        self, cfg: MlflowConfig, run_name: str, run_dir: Path, params: dict[str, Any], config_yaml: str
    ):
        self.cfg, self.run_dir, self.config_yaml = cfg, Path(run_dir), config_yaml
        self.params = {k: str(v)[:_VALUE_CHARS] for k, v in params.items()}  # as MLflow keeps them
        self.run_name = cfg.run_name or run_name
        self.local = cfg.tracking_uri is None
        self.store = RunDir(self.run_dir).tracker("mlflow")  # with no tracking_uri: a SQLite file here
        self.uri, self.artifacts = local_store(self.store) if self.local else (cfg.tracking_uri, None)
        self.client: Any = None
        self.run_id: str | None = None
        self.last_checkpoint: str | None = None

    # --------------------------------------------------------------------------------------- Tracker

    def open(self, state: dict[str, Any]) -> None:
        probe(self.uri)
        for name in ("alembic", "mlflow.store.db.utils"):  # a new SQLite store's ~60 migrations, each INFO
            logging.getLogger(name).setLevel(logging.WARNING)
        from mlflow import MlflowClient

        if self.local:
            self.store.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=self.uri)
        run_id = state.get("run_id") if state.get("tracking_uri") == self.uri else None
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
        else:
            run_id = self._find_or_create(client)
        self.client, self.run_id = client, run_id
        state.update(run_id=run_id, tracking_uri=self.uri)
        self._log_params()
        self._log_tags({**self.cfg.tags, "raytrain.run_dir": str(self.run_dir.resolve())})
        client.log_text(run_id, self.config_yaml, "config.yaml")

    def send(self, records: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        metrics, tags = [], {}
        for r in records:
            if r.get("kind") in ("train", "eval"):
                stamp = int(r.get("time", 0) * 1000)
                metrics += [Metric(k, v, stamp, r["step"]) for k, v in metric_values(r).items()]
            elif r.get("kind") == "event":
                tags.update(_event_tag(r))
                if r.get("event") == "checkpoint":
                    self.last_checkpoint = r.get("path")
                if r.get("event") == "exploit":  # loaded in place (a PBT trial): the run's params changed
                    tags.update(self._exploit_tags(r))
        for i in range(0, len(metrics), _METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + _METRICS_PER_CALL])
        self._log_tags(tags)

    def finish(self, status: str) -> None:
        if status == "FINISHED" and self.last_checkpoint:
            self.client.log_text(self.run_id, self.last_checkpoint + "\n", "final_checkpoint.txt")
            self.client.set_tag(self.run_id, "final_checkpoint", self.last_checkpoint)
        self.client.set_terminated(self.run_id, status)

    # --------------------------------------------------------------------------------------- helpers

    def _find_or_create(self, client: Any) -> str:
        experiment_id = ensure_experiment(client, self.cfg.experiment or self.run_name, self.artifacts)
        parent = self.cfg.parent_run_id
        tags = {"raytrain.kind": "train"}
        if parent:  # one child per run_name: a Tune trial's later Train runs continue its child run
            query = f"tags.mlflow.parentRunId = '{parent}' and tags.mlflow.runName = '{self.run_name}'"
            found = client.search_runs([experiment_id], filter_string=query, max_results=1)
            if found:
                client.update_run(found[0].info.run_id, status="RUNNING")
                return found[0].info.run_id
            tags["mlflow.parentRunId"] = parent
        return client.create_run(experiment_id, run_name=self.run_name, tags=tags).info.run_id

    def _log_params(self) -> None:
        """New keys as params; a key whose value changed since the run began (a resume with other
        hyperparameters, a PBT exploit) as a `changed.<key>` tag: MLflow refuses to change a param."""
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        new = [Param(k, v) for k, v in self.params.items() if k not in logged]
        for i in range(0, len(new), _PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=new[i : i + _PARAMS_PER_CALL])
        changed = {k: v for k, v in self.params.items() if k in logged and logged[k] != v}
        self._log_tags({f"changed.{k}": v for k, v in changed.items() if k not in _PER_ATTEMPT})

    def _exploit_tags(self, record: dict[str, Any]) -> dict[str, str]:
        """The tags an exploit in place brings (the trial's `exploit.<step>` ones), and `changed.<key>` for
        each new value that differs from the run's params, as a new run's `_log_params` would set them."""
        values = {k: str(v)[:_VALUE_CHARS] for k, v in (record.get("values") or {}).items()}
        changed = {f"changed.{k}": v for k, v in values.items() if k in self.params and self.params[k] != v}
        return {**(record.get("tags") or {}), **changed}

    def _log_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:_VALUE_CHARS]) for k, v in tags.items()]
        for i in range(0, len(items), _TAGS_PER_CALL):
            self.client.log_batch(self.run_id, tags=items[i : i + _TAGS_PER_CALL])


def ensure_experiment(client: Any, name: str, artifact_location: str | None) -> str:
    """The id of experiment `name`, created if missing (another process may create it meanwhile)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def probe(uri: str) -> None:
    """Fail fast (seconds, not the client's minutes of retries) when an HTTP tracking server is down."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    requests.get(uri.rstrip("/") + "/health", timeout=5)  # any answer will do: the server is there


def _event_tag(record: dict[str, Any]) -> dict[str, str]:
    event = record.get("event", "event")
    if event == "checkpoint":
        return {"checkpoint": str(record.get("path"))}
    fields = {k: v for k, v in record.items() if k not in ("kind", "event", "step", "tags")}
    return {f"event.{record.get('step', 0):08d}.{event}": json.dumps(fields, default=str)}
