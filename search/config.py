"""The experiment YAML of `raytrain tune`: a base run YAML plus a search space, a scheduler, a population
and a budget, validated into typed models before anything starts.

    name: pbt-demo
    base: tiny-dense.yaml            # run YAML, relative to this file
    overrides: {train.eval_batches: 4}
    space: {optimizer.lr: {loguniform: [1.0e-4, 1.0e-2]}}
    scheduler: {name: pbt, interval: 50}
    population: 4
    budget: {steps: 400}
    resources: {workers: 2}

Every member's starting run config is built and validated here (and the run config at each end of every
range), so that a bad key or value fails with one line before a worker starts.
"""

from __future__ import annotations

import json
import math
import random
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from search.schedulers import SchedulerConfig
from search.space import DISTRIBUTIONS, Choice, IntRange, Range, SearchSpace, parse_space
from trainers._base import ConfigError, StrictModel, flat_keys
from trainers.config import (
    RunConfig,
    TrainConfig,
    _one_line,
    apply_overrides,
    parse_config,
    read_yaml_mapping,
)
from trainers.fault_tolerance import check_fault_tolerance
from trainers.preflight import check_engine_installed, check_inputs
from trainers.storage import (
    Location,
    absolute,
    check_location,
    check_run_storage,
    default_root,
    is_uri,
    read_bytes,
    write_json_atomic,
)

__all__ = ["EXPERIMENT_FILE", "ExperimentConfig", "load_experiment", "load_saved", "parse_experiment", "save"]

EXPERIMENT_FILE = "experiment.json"  # in the experiment folder: the config as it ran (report, replay)

# Keys the driver owns: set per trial from the budget, the scheduler and the experiment directory.
_DRIVER_KEYS = (
    "name",
    "run_dir",
    "train.steps",
    "train.eval_every",
    "checkpoint.every",
    "checkpoint.resume",
    "scaling.",
)
# What PBT and PB2 may change during a run: what a restored optimizer and the closed-form LR schedule
# take as they are (the model, data position and optimizer kind are fixed by the donor's checkpoint).
_LIVE_PREFIXES = ("optimizer.", "schedule.")
_NOT_LIVE = ("optimizer.name",)


class BudgetConfig(StrictModel):
    steps: PositiveInt | None = None  # optimizer steps per trial (None = the base run's train.steps)
    time_s: PositiveFloat | None = None  # wall-clock limit of the whole experiment


class ResourcesConfig(StrictModel):
    workers: PositiveInt = 1  # Ray Train workers per trial (the run's scaling.num_workers)
    cpus_per_worker: PositiveFloat = Field(
        1.0, description="CPUs Ray reserves for each worker (fractions share a core)"
    )
    use_gpu: bool = False  # one GPU per worker


class ExperimentConfig(StrictModel):
    name: str = Field("experiment", description="the experiment folder is storage/name")
    base: Path  # the run YAML every trial starts from (relative to the experiment file)
    overrides: dict[str, Any] = {}  # dotted run-config keys set on the base for every trial
    space: dict[str, Any]  # dotted run-config key -> range, list of choices, or fixed value
    initial: list[dict[str, Any]] = []  # starting values of the first members (the rest are sampled)
    scheduler: SchedulerConfig = SchedulerConfig()
    population: PositiveInt = 4  # trials (pbt/pb2: the population; asha/random: the samples)
    budget: BudgetConfig = BudgetConfig()
    metric: str = Field(
        "val_loss",
        description="what the scheduler ranks trials by: val_loss, train_loss, or any value the run logs as "
        "KIND/KEY: train/loss, eval/val_loss, or a callback's own eval value (eval/accuracy: see "
        "TrainerCallback.after_eval); with mode",
    )
    mode: Literal["min", "max"] = Field("min", description="whether a lower or a higher metric is better")
    resources: ResourcesConfig = ResourcesConfig()
    # how a trial trains between reports: a bounded Train run per interval, or one run kept alive
    trial_runs: Literal["segments", "live"] = "live"
    max_concurrent_trials: PositiveInt | None = None  # None = as many as the cluster's CPUs/GPUs hold
    keep_checkpoints: PositiveInt = 3  # newest Tune checkpoints per trial (plus any an exploit still needs)
    callbacks: list[str] = []  # TrainerCallbacks ("module:Name(...)") in every trial's Train run workers
    # the experiment directory is storage/name: a local folder, or a bucket (s3://bucket/tune, gs://...);
    # default $RAYTRAIN_STORAGE/tune (a cluster's bucket, clusters/*.yaml), else runs/tune
    storage: Location = Field(default_factory=lambda: default_root("tune"))
    seed: int = 0  # initial samples and explore decisions
    _base_raw: dict[str, Any] | None = PrivateAttr(None)

    @field_validator("metric")
    @classmethod
    def _metric_form(cls, metric: str) -> str:
        if metric in METRIC_ALIASES or re.fullmatch(r"(train|eval)/[A-Za-z_][\w.]*", metric):
            return metric
        raise ValueError(
            f"metric={metric!r} is not a metric a run logs; fix: val_loss, train_loss, or KIND/KEY with KIND train "
            f"or eval (train/loss, eval/accuracy)"
        )

    @property
    def metric_key(self) -> str:
        """The key of the metric in a run's reports (train and eval values merged: their keys differ)."""
        return METRIC_ALIASES.get(self.metric) or self.metric.split("/", 1)[1]

    @field_validator("base")
    @classmethod
    def _absolute(cls, path: Path) -> Path:
        # resolved here, in the driver: trials run in Tune's per-trial working directories
        return path.resolve()

    @field_validator("storage")
    @classmethod
    def _absolute_storage(cls, path: Any) -> Any:
        return absolute(path)

    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        if self.metric.startswith("eval/") and self.metric_key != "val_loss" and not self.callbacks:
            raise ValueError(
                f"metric={self.metric}: a run's eval records hold val_loss only, and no callback is given to "
                f"add {self.metric_key!r}; fix: callbacks: [mypkg.hooks:MyEval] (its after_eval adds the "
                f"value to the record), or metric: val_loss"
            )
        if len(self.initial) > self.population:
            raise ValueError(
                f"initial lists {len(self.initial)} members but population={self.population}; "
                f"fix: raise population or shorten initial"
            )
        return self

    # ------------------------------------------------------------------------------------ derived

    @property
    def exp_dir(self) -> Path | Any:
        return self.storage / self.name

    @cached_property
    def search_space(self) -> SearchSpace:
        return parse_space(self.space)

    @property
    def steps(self) -> int:
        """Optimizer steps per trial: budget.steps, else the base run's train.steps."""
        if self.budget.steps is not None:
            return self.budget.steps
        train = self.base_raw.get("train")
        steps = train.get("steps", TrainConfig().steps) if isinstance(train, dict) else TrainConfig().steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ConfigError(
                f"train.steps={steps!r} is not a positive integer; fix: set budget.steps, or train.steps in "
                f"{self.base}"
            )
        return steps

    @property
    def base_raw(self) -> dict[str, Any]:
        """The base run YAML with the overrides applied and data.path made absolute."""
        if self._base_raw is None:
            self._base_raw = _load_base(self)
        return self._base_raw

    def members(self) -> list[dict[str, Any]]:
        """Starting hyperparameters of each member: `initial` first, then seeded samples."""
        rng = random.Random(self.seed)
        out = []
        for i in range(self.population):
            sampled = self.search_space.sample(rng)  # drawn for every member: `initial` keeps the stream
            out.append({**sampled, **(self.initial[i] if i < len(self.initial) else {})})
        return out

    def run_raw(self, hparams: dict[str, Any], **driver: Any) -> dict[str, Any]:
        """The raw run config of a trial: base + overrides + hyperparameters + driver-owned keys."""
        hparams = self.search_space.coerce(hparams)
        raw = apply_overrides(self.base_raw, [f"{k}={_yaml(v)}" for k, v in hparams.items()])
        scaling = {
            k: v for k, v in (raw.get("scaling") or {}).items() if k not in ("min_workers", "max_workers")
        }
        raw["scaling"] = {
            **scaling,
            "num_workers": self.resources.workers,
            "cpus_per_worker": self.resources.cpus_per_worker,
            "use_gpu": self.resources.use_gpu,
        }
        fixed = {
            "train.steps": self.steps,
            "train.eval_every": self.scheduler.interval,
            "checkpoint.every": self.scheduler.interval,
            "checkpoint.resume": "none",
            **driver,
        }
        return apply_overrides(raw, [f"{k}={_yaml(v)}" for k, v in fixed.items()])

    def run_config(self, hparams: dict[str, Any], **driver: Any) -> RunConfig:
        return parse_config(self.run_raw(hparams, **driver))

    @property
    def per_step(self) -> bool:
        """Whether each trial's run is torchft replica groups (the base run's `scaling.fault_tolerance`)."""
        return (self.base_raw.get("scaling") or {}).get("fault_tolerance") == "per_step"


# ----------------------------------------------------------------------------------------- loading


def load_experiment(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read and validate an experiment YAML (`--set` overrides apply to it). Raises ConfigError."""
    path = Path(path)
    raw = read_yaml_mapping(path, "experiment", "name:, base:, space:, ...")
    _check_space_overrides(overrides)
    raw = apply_overrides(raw, overrides, flat=("space",))  # --set space.optimizer.lr=...: one space entry
    if isinstance(raw.get("base"), str) and not Path(raw["base"]).is_absolute():
        raw["base"] = str(path.parent / raw["base"])
    return parse_experiment(raw)


def _check_space_overrides(overrides: list[str] | tuple[str, ...]) -> None:
    """`--set space.optimizer.lr.loguniform=[lo, hi]` reads as a run-config key `optimizer.lr.loguniform`:
    one line with the form that works, not the run config's complaint that lr is not a section."""
    for item in overrides:
        key, _, value = item.partition("=")
        head, _, kind = key.strip().rpartition(".")
        if head.startswith("space.") and kind in DISTRIBUTIONS:
            raise ConfigError(
                f"--set {key.strip()}: a distribution is the value of its key, not part of the key; "
                f"fix: --set '{head}={{{kind}: {value.strip() or '[lo, hi]'}}}'"
            )


# the metrics a search could always rank by, by their names before KIND/KEY: their keys in a run's reports
METRIC_ALIASES = {"val_loss": "val_loss", "train_loss": "loss"}


def parse_experiment(raw: dict[str, Any]) -> ExperimentConfig:
    try:
        exp = ExperimentConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e, ExperimentConfig)) from None
    _check_space(exp)
    _check_budget(exp)
    return exp


def save(exp: ExperimentConfig) -> Path | Any:
    path = exp.exp_dir / EXPERIMENT_FILE
    dump = {"experiment": exp.model_dump(mode="json", exclude_unset=True), "base_raw": exp.base_raw}
    write_json_atomic(path, dump)
    return path


def load_saved(exp_dir: str | Path) -> ExperimentConfig:
    """The experiment an `EXP_DIR` ran (wherever that folder is now: a moved folder, a bucket)."""
    exp_dir = absolute(exp_dir)
    check_location(exp_dir, "EXP_DIR", write=False)  # a bucket: there, with credentials (one line if not)
    path = exp_dir / EXPERIMENT_FILE
    text = read_bytes(path)
    if text is None:
        raise ConfigError(f"{exp_dir} holds no {EXPERIMENT_FILE}; fix: pass the folder `raytrain tune` wrote")
    data = json.loads(text)
    raw = {**data["experiment"], "storage": str(exp_dir.parent), "name": exp_dir.name}
    exp = ExperimentConfig.model_validate(raw)
    exp._base_raw = data["base_raw"]
    return exp


def _load_base(exp: ExperimentConfig) -> dict[str, Any]:
    if not exp.base.is_file():
        raise ConfigError(f"base={exp.base}: run YAML not found; fix: a path relative to the experiment file")
    try:
        raw = read_yaml_mapping(exp.base, "run", "of sections: model:, data:, ...")
    except ConfigError as e:  # "PATH is not valid YAML: ..." -> "base=PATH is not valid YAML: ..."
        raise ConfigError(f"base={e}") from None
    raw = apply_overrides(raw, [f"{k}={_yaml(v)}" for k, v in flat_keys(exp.overrides).items()])
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    if "path" in data and not is_uri(data["path"]):  # trials run in other working directories
        data["path"] = str(Path(data["path"]).resolve())
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    if model.get("init_from") and not is_uri(model["init_from"]):  # the same for the pretrained model's folder
        model["init_from"] = str(Path(model["init_from"]).resolve())
    return raw


def _check_space(exp: ExperimentConfig) -> None:
    space = exp.search_space
    for key in space:
        if key in _DRIVER_KEYS or key.startswith(_DRIVER_KEYS[-1]):
            raise ConfigError(
                f"space.{key} is set by the tune driver; fix: remove it (budget.steps sets train.steps, "
                f"scheduler.interval eval_every and checkpoint.every, resources the scaling)"
            )
        mutable = isinstance(space[key], (Range, IntRange, Choice))
        live = key.startswith(_LIVE_PREFIXES) and key not in _NOT_LIVE
        if exp.scheduler.exploits and mutable and not live:
            raise ConfigError(
                f"space.{key}: {exp.scheduler.name} changes hyperparameters during a run, and only optimizer.* "
                f"(not name) and schedule.* keys can change once training started; fix: make it a fixed "
                f"value or use scheduler.name=asha/random"
            )
        if exp.scheduler.name == "pb2" and isinstance(space[key], Choice):
            raise ConfigError(
                f"space.{key}: pb2 searches continuous ranges only; fix: use a uniform/loguniform/int range "
                f"or scheduler.name=pbt"
            )
    if exp.scheduler.exploits and not space.mutable:
        raise ConfigError(f"space has no range or list for {exp.scheduler.name} to mutate; fix: add one")
    if exp.scheduler.name == "pb2":
        try:
            import sklearn  # noqa: F401
        except ImportError:
            raise ConfigError(
                "scheduler.name=pb2 needs scikit-learn; fix: pip install scikit-learn"
            ) from None
    for i, member in enumerate(exp.initial):
        for key, value in member.items():
            if key not in space:
                raise ConfigError(f"initial[{i}].{key} is not in space; fix: add space.{key} or remove it")
            if not space.contains(key, value):
                raise ConfigError(
                    f"initial[{i}].{key}={value!r} lies outside space.{key}; fix: a value inside it"
                )
    _check_runs(exp, space)


def _check_budget(exp: ExperimentConfig) -> None:
    """Scheduler values that leave a search nothing to do within the budget (trials report at every
    multiple of scheduler.interval and at the last step)."""
    sched, steps = exp.scheduler, exp.steps
    budget = f"budget.steps={steps}" if exp.budget.steps else f"the base run's train.steps={steps} (no budget.steps)"
    if sched.interval > steps:
        raise ConfigError(
            f"scheduler.interval={sched.interval} is larger than {budget}: a trial would report only at its "
            f"end; fix: set scheduler.interval <= {steps} or raise budget.steps"
        )
    if (sched.exploits or sched.name == "asha") and exp.population < 2:
        raise ConfigError(
            f"population={exp.population}: {sched.name} compares trials with each other; fix: set population "
            f">= 2 or scheduler.name=random"
        )
    if sched.exploits:
        burn_in_steps = sched.burn_in_steps(steps)
        first = max(1, math.ceil(burn_in_steps / sched.interval)) * sched.interval  # PBT's first decision
        if first >= steps:
            burn_in = f" and burn_in={sched.burn_in}" if burn_in_steps else ""
            raise ConfigError(
                f"scheduler.interval={sched.interval}{burn_in} leave{'' if burn_in else 's'} {sched.name} no decision before the end of "
                f"{budget} (the first would be at step {first}); fix: a smaller scheduler.interval"
                f"{' or burn_in' if burn_in else ''}, or raise budget.steps"
            )
    grace = sched.grace_period or sched.interval
    if sched.name == "asha" and grace >= steps:
        raise ConfigError(
            f"scheduler.grace_period={grace} (default: interval) is not below {budget}: asha would stop no "
            f"trial early; fix: a smaller scheduler.grace_period or interval, or raise budget.steps"
        )


def _check_runs(exp: ExperimentConfig, space: SearchSpace) -> None:
    """Validate runs from the narrowest change outwards, so that an error names its cause: the base
    alone, then one key at a time (at each end of its range, at each choice), then each member."""
    members = exp.members()
    probes: list[tuple[str, dict[str, Any]]] = [("base", {})]
    for key, p in space.items():
        ends = p.bounds if isinstance(p, (Range, IntRange)) else p.values if isinstance(p, Choice) else ()
        values = [int(v) if isinstance(p, IntRange) else v for v in ends] or [members[0][key]]
        probes += [(f"space.{key}: the run at {key}={v!r} is invalid", {key: v}) for v in values]
    probes += [(f"member {i}", m) for i, m in enumerate(members)]
    for label, hparams in probes:
        try:
            cfg = exp.run_config(hparams, run_dir=str(exp.exp_dir / "probe"))
            check_engine_installed(cfg)  # a space may choose the engine
            check_fault_tolerance(cfg)  # per-step replica groups: each member's batch must split over them
        except ConfigError as e:  # (a trial's scaling.num_workers is the experiment's resources.workers)
            raise ConfigError(f"{label}: {e}".replace("scaling.num_workers", "resources.workers")) from None
    if exp.per_step and exp.trial_runs == "segments":
        raise ConfigError(
            "trial_runs=segments with scaling.fault_tolerance=per_step: a segment ends where its checkpoint "
            "commits, which only the replica group writing it hears; fix: trial_runs=live (the default)"
        )
    if exp.per_step:
        from raytrain_ext.run_checks import check_replica_groups_on_ray

        check_replica_groups_on_ray()
    # A bucket: there, with credentials, writable (storage) and readable (data), in one line each, first.
    check_location(exp.exp_dir, "storage", write=True)
    check_run_storage(cfg)
    check_inputs(cfg)


def _yaml(value: Any) -> str:
    """A value as a `--set` right-hand side (parsed back as YAML)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()
