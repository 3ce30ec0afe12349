"""The toy problem of the PBT paper (Jaderberg et al. 2017, fig. 2), run through this package's search
layer: a check that exploit and explore work end to end, on Tune function trials without Train workers.

Maximise Q(t) = 1.2 - (t0^2 + t1^2) while each worker only ascends the surrogate
Q^(t|h) = 1.2 - (h0 t0^2 + h1 t1^2). Two workers start at t = (0.9, 0.9) with h = (1, 0) and (0, 1): alone,
each can only shrink one coordinate and ends at Q = 1.2 - 0.81 = 0.39; copying the better one's t and
exploring h lets the population shrink both (Q -> 1.2).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from ray import tune

from search.schedulers import TIME_ATTR, SchedulerConfig, build_scheduler, population_space
from search.space import parse_space

__all__ = ["TOY_LR", "TOY_MEMBERS", "TOY_SPACE", "run_toy", "toy_trainable"]

TOY_SPACE = parse_space({"h0": {"uniform": [0.0, 1.0]}, "h1": {"uniform": [0.0, 1.0]}})
TOY_MEMBERS = [{"h0": 1.0, "h1": 0.0}, {"h0": 0.0, "h1": 1.0}]
TOY_LR = 0.2  # gradient-ascent step on the surrogate
START = (0.9, 0.9)


def q_value(theta: np.ndarray) -> float:
    return float(1.2 - np.sum(theta**2))


def toy_trainable(config: dict[str, Any]) -> None:
    """A Tune function trial: `interval` ascent steps on the surrogate per report, each report with a
    checkpoint (theta and step) that PBT can hand to the other worker."""
    h = np.array([config["h0"], config["h1"]], dtype=float)
    theta, step = np.array(START), 0
    checkpoint = tune.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = json.loads((Path(d) / "state.json").read_text())
        theta, step = np.array(state["theta"]), state["step"]
    while step < config["steps"]:
        for _ in range(config["interval"]):
            theta = theta + TOY_LR * (-2.0 * h * theta)  # gradient of the surrogate, not of Q
            step += 1
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "state.json").write_text(json.dumps({"theta": theta.tolist(), "step": step}))
            metrics = {"Q": q_value(theta), TIME_ATTR: step, "h0": h[0], "h1": h[1]}
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))


def run_toy(
    seed: int, steps: int, storage: Path, pbt: bool = True, interval: int = 4, synch: bool = True
) -> dict[str, Any]:
    """One experiment of the two workers; `pbt=False` is the grid (fixed h, no exploit or explore).
    Returns the best final Q of the population and each worker's Q curve."""
    name = f"toy-{'pbt' if pbt else 'grid'}-{seed}"
    if pbt:  # two workers, quantile 0.5: the worse one copies the better one, from the first report (the paper's)
        sched = SchedulerConfig(name="pbt", interval=interval, burn_in=0, quantile_fraction=0.5, synch=synch)
    else:
        sched = SchedulerConfig(name="random", interval=interval)
    scheduler = build_scheduler(sched, TOY_SPACE, steps, seed=seed)
    tuner = tune.Tuner(
        toy_trainable,
        param_space={**population_space(TOY_MEMBERS), "steps": steps, "interval": interval},
        tune_config=tune.TuneConfig(scheduler=scheduler, metric="Q", mode="max", reuse_actors=True),
        run_config=tune.RunConfig(
            name=name,
            storage_path=str(Path(storage).resolve()),
            verbose=0,
            stop={TIME_ATTR: steps},
        ),
    )
    results = tuner.fit()
    curves = [r.metrics_dataframe["Q"].tolist() for r in results]
    return {"seed": seed, "pbt": pbt, "best_q": max(r.metrics["Q"] for r in results), "curves": curves}
