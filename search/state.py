"""The state files of an experiment folder, read with checks: a truncated, empty or foreign file gives one
line naming it and the fix (a ConfigError: exit 2), not a traceback from deep inside Tune or pydantic.

- `experiment.json` (ours): the experiment as it ran; `report`, `replay` and `--resume` read it.
- `tuner.pkl`, `experiment_state-*.json`, `callback-states-*.pkl` (Tune's): what `--resume` restores.
  Tune reads the newest of each (by name: the names carry the session's start time).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from search.config import EXPERIMENT_FILE, ExperimentConfig, load_saved
from trainers._base import ConfigError, flat_keys
from trainers.storage import absolute, list_sizes, location, read_bytes

__all__ = ["check_same_experiment", "check_tune_state", "has_tune_state", "load_experiment_dir",
           "saved_trial_statuses"]

_REWRITE = "fix: delete it and run `raytrain tune EXP.yaml --resume` with the experiment's YAML, which writes it again"


def load_experiment_dir(exp_dir: str | Path) -> ExperimentConfig:
    """`search.config.load_saved`, with a damaged `experiment.json` as one line."""
    path = absolute(exp_dir) / EXPERIMENT_FILE
    try:
        return load_saved(exp_dir)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSON and pydantic errors are ValueErrors
        raise ConfigError(f"{path} is damaged ({_why(e)}); {_REWRITE}") from None


def check_same_experiment(exp: ExperimentConfig, exp_dir: Path) -> None:
    """`--resume` continues the experiment that `experiment.json` describes: Tune restores its own copy of
    the population, scheduler and budget, while the trials would build their runs from the YAML given
    now, and report/replay would read the file. Any difference is refused, naming the first key."""
    if read_bytes(exp_dir / EXPERIMENT_FILE) is None:  # started by a script that did not save it
        return
    saved = load_experiment_dir(exp_dir)
    now, then = _flat_experiment(exp), _flat_experiment(saved)
    for key in sorted(set(now) | set(then)):
        if now.get(key) != then.get(key):
            raise ConfigError(
                f"--resume: {key} is {now.get(key)!r} here but the experiment in {exp_dir} ran with "
                f"{then.get(key)!r}; fix: resume with the YAML and --set values it ran with, or start a new "
                f"experiment (another name or storage)"
            )


def _flat_experiment(exp: ExperimentConfig) -> dict[str, Any]:
    # name and storage are the folder itself; base is where the run YAML was (its content is base_raw)
    dump = exp.model_dump(mode="json", exclude={"name", "storage", "base"})
    base = json.loads(json.dumps(exp.base_raw))  # as experiment.json holds it (e.g. no int keys)
    return {**flat_keys(dump), **flat_keys(base, "base run: ")}


def has_tune_state(exp_dir: Path) -> bool:
    """Whether Tune saved this experiment's state (what `--resume` needs). Tune writes `tuner.pkl` as it
    starts and its first state at its first step: a folder with `tuner.pkl` alone was stopped at once and
    may be started again."""
    files = list_sizes(exp_dir)
    return "tuner.pkl" in files and _newest(files, "experiment_state-", ".json") is not None


def _newest(files: dict[str, int], prefix: str, suffix: str) -> str | None:
    """The newest of Tune's state files of one kind (their names carry the session's start)."""
    return max((n for n in files if n.startswith(prefix) and n.endswith(suffix)), default=None)


def saved_trial_statuses(exp_dir: Path) -> dict[str, str]:
    """Each trial's status in Tune's newest saved state (PENDING, RUNNING, PAUSED, TERMINATED, ERROR)."""
    newest = _newest(list_sizes(exp_dir), "experiment_state-", ".json")
    if newest is None:
        return {}
    data = json.loads(read_bytes(location(exp_dir) / newest))["trial_data"]
    return {t["trial_id"]: t["status"] for t in (json.loads(state) for state, _ in data)}


def check_tune_state(exp_dir: Path) -> None:
    """Tune's files that `Tuner.restore` reads (the newest of each): one line for a damaged one, before
    anything starts. Pickles of this experiment's own driver, trusted like every file of a run folder."""
    import ray.cloudpickle as pickle

    files = list_sizes(exp_dir)
    state = _newest(files, "experiment_state-", ".json")  # has_tune_state: there is one
    checks = [(exp_dir / "tuner.pkl", pickle.loads), (exp_dir / state, json.loads)]
    callbacks = _newest(files, "callback-states-", ".pkl")
    checks += [(exp_dir / callbacks, pickle.loads)] if callbacks else []
    for path, load in checks:
        try:
            load(read_bytes(path))
        except Exception as e:  # anything a damaged pickle or JSON raises
            raise ConfigError(
                f"--resume: Tune's {path} is damaged ({_why(e)}); fix: restore it from a copy, or start "
                f"the experiment again under another name or storage"
            ) from None


def _why(e: BaseException) -> str:
    from pydantic import ValidationError

    if isinstance(e, ValidationError):  # its text spans lines: the first error, where and what
        first = e.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc']) or 'the file'}: {first['msg']}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__
