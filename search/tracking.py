"""MLflow for a Tune experiment whose run config has `tracking.mlflow`: one parent run for the experiment
(`start_experiment_run`, continued by `--resume`; `finish_experiment_run` ends it with the best trial), one
child run per trial, continued by each of the trial's Train runs (`trial_tracking`), the trial's exploits as
its tags (`exploit.<step>`). Each Train run's rank 0 sends the metrics (`trainers.tracking`). Without a
`tracking_uri` the store is SQLite in `EXP_DIR/mlflow/`. A server that fails never stops the experiment:
it is said in one line, and the trials log runs of their own once it answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from search.config import ExperimentConfig
from trainers._base import first_line, flat_keys
from trainers.storage import read_bytes, write_json_atomic
from trainers.tracking import MlflowConfig

__all__ = ["catch_up", "finish_experiment_run", "start_experiment_run", "in_place_tags", "trial_tracking"]

PARENT_FILE = "mlflow/parent.json"  # in the experiment folder: the store, experiment name and parent run


def _mlflow(exp: ExperimentConfig) -> MlflowConfig | None:
    return exp.run_config(exp.members()[0]).tracking.mlflow


def start_experiment_run(exp: ExperimentConfig) -> None:
    """Create the experiment's parent run (or continue the one a resumed experiment made)."""
    from trainers.tracking.mlflow_tracker import ensure_experiment, local_store, probe

    cfg = _mlflow(exp)
    if cfg is None:
        return
    uri, artifacts = (cfg.tracking_uri, None) if cfg.tracking_uri else local_store(exp.exp_dir / "mlflow")
    state = {"tracking_uri": uri, "experiment": cfg.experiment or exp.name}
    saved = _read(exp.exp_dir)
    try:
        probe(uri)
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=uri)
        if saved.get("parent_run_id") and saved.get("tracking_uri") == uri:
            state["parent_run_id"] = saved["parent_run_id"]
            client.update_run(state["parent_run_id"], status="RUNNING")
        else:
            experiment_id = ensure_experiment(client, state["experiment"], artifacts)
            tags = {**cfg.tags, "raytrain.kind": "tune-experiment", "raytrain.exp_dir": str(exp.exp_dir)}
            run = client.create_run(experiment_id, run_name=exp.name, tags=tags)
            state["parent_run_id"] = run.info.run_id
            params = [Param(k, str(v)[:5000]) for k, v in flat_keys(exp.model_dump(mode="json")).items()]
            for i in range(0, len(params), 100):
                client.log_batch(run.info.run_id, params=params[i : i + 100])
    except Exception as e:  # noqa: BLE001 - tracking never stops an experiment
        _say(f"no parent run for the experiment ({type(e).__name__}: {first_line(e)}); "
             "trials log runs of their own")
    write_json_atomic(exp.exp_dir / PARENT_FILE, state, indent=None)


def finish_experiment_run(exp: ExperimentConfig, result: Any) -> None:
    """Send what the trials' last Train runs left unsent, then tag the parent run with the best trial and
    end it (FINISHED, or KILLED when interrupted)."""
    state = _read(exp.exp_dir)
    if not state:
        return
    catch_up(exp.exp_dir)
    if not state.get("parent_run_id"):
        return
    try:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=state["tracking_uri"])
        run_id = state["parent_run_id"]
        if result.best_trial is not None:
            client.set_tag(run_id, "best_trial", result.best_trial)
            client.log_metric(run_id, f"best_{exp.metric}", float(result.best_metric))
        client.set_terminated(run_id, "FINISHED" if result.finished else "KILLED")
    except Exception as e:  # noqa: BLE001
        _say(f"could not end the experiment's parent run ({type(e).__name__}: {first_line(e)})")


def catch_up(exp_dir: Path, timeout_s: float = 10.0) -> None:
    """Send what the trials' Train runs recorded but their tracker did not: Tune ends the last Train runs
    without waiting for their rank 0 to finish sending. Stops at the first run that fails (the server is
    down: metrics.jsonl keeps it all)."""
    from trainers.tracking import send_unsent

    for metrics in sorted(exp_dir.glob("runs/*/*/metrics.jsonl"), key=lambda p: p.stat().st_mtime):
        if not send_unsent(metrics.parent, timeout_s):
            return


def trial_tracking(exp: ExperimentConfig, trial: str) -> dict[str, Any]:
    """Dotted run-config keys for a Train run of `trial` ({} when the experiment does not track)."""
    state = _read(exp.exp_dir)
    if not state:
        return {}
    cfg = _mlflow(exp)
    out: dict[str, Any] = {
        "tracking.mlflow.tracking_uri": state["tracking_uri"],
        "tracking.mlflow.experiment": state["experiment"],
        "tracking.mlflow.run_name": trial,
        "tracking.mlflow.tags": {**(cfg.tags if cfg else {}), "raytrain.trial": trial,
                                 **_exploit_tags(exp, trial)},
    }
    if state.get("parent_run_id"):
        out["tracking.mlflow.parent_run_id"] = state["parent_run_id"]
    return out


def in_place_tags(exp: ExperimentConfig, trial: str) -> dict[str, str]:
    """The `exploit.<step>` tags for an exploit loaded into a running Train run ({} when the experiment does
    not track): no new run carries `trial_tracking`'s, so the exploit event takes them to its tracker."""
    return _exploit_tags(exp, trial) if _read(exp.exp_dir) else {}


def _exploit_tags(exp: ExperimentConfig, trial: str) -> dict[str, str]:
    """`exploit.<step>`: the donor, both scores and each hyperparameter's change (from the lineage log)."""
    data = read_bytes(exp.exp_dir / "lineage" / f"{trial}.jsonl") or b""
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    tags = {}
    for r in (r for r in rows if r.get("kind") == "exploit"):
        old = r.get("old_hparams") or {}
        changes = ", ".join(f"{k} {_num(old.get(k))} -> {_num(v)}" for k, v in r["new_hparams"].items())
        tags[f"exploit.{r['step']:08d}"] = (
            f"from {r['donor']} ({exp.metric} {_num(r.get('donor_score'))}, was {_num(r.get('score'))}): {changes}"
        )
    return tags


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _read(exp_dir: Path) -> dict[str, Any]:
    try:
        return json.loads(read_bytes(exp_dir / PARENT_FILE) or b"{}")
    except (OSError, ValueError):
        return {}


def _say(line: str) -> None:
    print(f"raytrain: tracking: mlflow: {line}", file=sys.stderr, flush=True)
