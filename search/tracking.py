"""MLflow for a Tune experiment whose run config has `tracking.mlflow`: one parent run for the experiment,
one child run per trial, the trial's exploits as tags of its child.

The driver starts the parent run before Tune starts (`start_experiment_run`; `--resume` continues it) and
ends it with the best trial (`finish_experiment_run`). Every Train run of a trial gets `trial_tracking`:
the experiment's store (without a `tracking_uri`, a SQLite store in `EXP_DIR/mlflow/`), the parent's id
and the trial's id as run name, so that the trial's later Train runs (after an exploit, each segment)
continue its one child, and the trial's exploits so far as tags (`exploit.<step>`). The metrics
themselves are sent by the trainers' tracker in each Train run's rank 0 (`trainers.tracking`).

The tracking server is never in the way: a parent run that cannot be made is said in one line, and the
trials then log runs of their own once the server answers.
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
        _say(
            f"no parent run for the experiment ({type(e).__name__}: {first_line(e)}); trials log runs of their own"
        )
    _write(exp.exp_dir, state)


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
    """Send what the trials' Train runs recorded but their tracker did not: when an experiment ends, Tune
    ends its last Train runs without waiting for their rank 0 to finish sending (a tracker still opening a
    new store, or a slow server, would lose the rest of the run). Stops at the first run that fails (the
    server is down: metrics.jsonl keeps it all)."""
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
        "tracking.mlflow.tags": {
            **(cfg.tags if cfg else {}),
            "raytrain.trial": trial,
            **_exploit_tags(exp, trial),
        },
    }
    if state.get("parent_run_id"):
        out["tracking.mlflow.parent_run_id"] = state["parent_run_id"]
    return out


def in_place_tags(exp: ExperimentConfig, trial: str) -> dict[str, str]:
    """The `exploit.<step>` tags of a trial whose exploit is loaded into its running Train run ({} when the
    experiment does not track): no new run starts to carry `trial_tracking`'s, so the exploit event takes
    them to the run's own tracker (`MlflowTracker.send`), which sets them with the `changed.<key>` ones."""
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


def _write(exp_dir: Path, state: dict[str, Any]) -> None:
    write_json_atomic(exp_dir / PARENT_FILE, state, indent=None)


def _say(line: str) -> None:
    print(f"raytrain: tracking: mlflow: {line}", file=sys.stderr, flush=True)
