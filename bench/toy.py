"""The toy problem of the PBT paper (Jaderberg et al. 2017, fig. 2), run through the search package's population
(bench/pbt_toy.py and tests/ray/test_toy_pbt.py): a check that exploit and explore work end to end, on Tune
function trials without Train workers.

Maximise Q(t) = 1.2 - (t0^2 + t1^2) while each worker only ascends the surrogate
Q^(t|h) = 1.2 - (h0 t0^2 + h1 t1^2). Two workers start at t = (0.9, 0.9) with h = (1, 0) and (0, 1): alone,
each can only shrink one coordinate and ends at Q = 1.2 - 0.81 = 0.39; copying the better one's t and
exploring h lets the population shrink both (Q -> 1.2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray import tune

from search.population import Population, PopulationActor
from search.schedulers import MEMBER, TIME_ATTR, SchedulerConfig, build_scheduler, population_space
from search.space import parse_space

__all__ = ["TOY_LR", "TOY_MEMBERS", "TOY_SPACE", "run_toy", "toy_trainable"]

TOY_SPACE = parse_space({"h0": {"uniform": [0.0, 1.0]}, "h1": {"uniform": [0.0, 1.0]}})
TOY_MEMBERS = [{"h0": 1.0, "h1": 0.0}, {"h0": 0.0, "h1": 1.0}]
TOY_LR = 0.2  # gradient-ascent step on the surrogate
START = (0.9, 0.9)


def q_value(theta: np.ndarray) -> float:
    return float(1.2 - np.sum(theta**2))


def toy_trainable(config: dict[str, Any]) -> None:
    """A Tune function trial: `interval` ascent steps on the surrogate per report. Each report's state
    (theta and step) is written where the other member can load it (its *pin*), handed to the population
    (`config["population"]`: the actor's name, None for the grid), and its decision followed: an exploit
    loads the donor's state with the explored h."""
    trial = tune.get_context().get_trial_id()
    population = ray.get_actor(config["population"]) if config["population"] else None
    pins = Path(config["pins"]) / trial
    pins.mkdir(parents=True, exist_ok=True)
    h = np.array([config["h0"], config["h1"]], dtype=float)
    theta, step = np.array(START), 0
    while step < config["steps"]:
        for _ in range(config["interval"]):
            theta = theta + TOY_LR * (-2.0 * h * theta)  # gradient of the surrogate, not of Q
            step += 1
        q = q_value(theta)
        tune.report({"Q": q, TIME_ATTR: step, "h0": h[0], "h1": h[1]})
        if population is None:
            continue
        pin = pins / f"{step}.json"
        pin.write_text(json.dumps({"theta": theta.tolist(), "step": step}))
        hparams = {"h0": float(h[0]), "h1": float(h[1])}
        decision = ray.get(population.report.remote(trial, config[MEMBER], step, q, hparams, str(pin)))
        while decision is None:
            decision = ray.get(population.decision.remote(trial, step, 5.0))
        if decision != "go":
            state = json.loads(Path(decision["pin"]).read_text())
            theta, step = np.array(state["theta"]), state["step"]
            h = np.array([decision["values"]["h0"], decision["values"]["h1"]])
            ray.get(population.taken.remote(trial, decision["exploit_id"], True))


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
    actor = None
    if pbt:
        population = Population(sched, TOY_SPACE, "max", steps, len(TOY_MEMBERS), seed=seed)
        actor = ray.remote(num_cpus=0)(PopulationActor).options(name=f"toy-population-{name}").remote(population)
    try:
        tuner = tune.Tuner(
            toy_trainable,
            param_space={
                **population_space(TOY_MEMBERS),
                "steps": steps,
                "interval": interval,
                "population": f"toy-population-{name}" if pbt else None,
                "pins": str(Path(storage).resolve() / name / "pins"),
            },
            tune_config=tune.TuneConfig(scheduler=build_scheduler(sched, steps), metric="Q", mode="max"),
            run_config=tune.RunConfig(
                name=name,
                storage_path=str(Path(storage).resolve()),
                verbose=0,
                stop={TIME_ATTR: steps},
            ),
        )
        results = tuner.fit()
    finally:
        if actor is not None:
            ray.kill(actor)
    curves = [r.metrics_dataframe["Q"].tolist() for r in results]
    return {"seed": seed, "pbt": pbt, "best_q": max(r.metrics["Q"] for r in results), "curves": curves}
