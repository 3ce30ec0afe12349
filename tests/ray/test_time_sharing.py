"""PBT with a population twice what the cluster holds (issue 25): 4 members, each a Train run of 1 worker of
1 CPU, on a local Ray of 2 CPUs. Members take turns at the 2 slots (`search.slots`), yielding at report
boundaries, so every member reaches every interval and PBT exploits as on a full cluster (before, Tune's
concurrency limit ran the members one after another: 0 exploits).

Synchronous PBT, the case where taking turns matters most (a round is decided once every member reported,
and only half of them can run at once): every member reaches the budget; at most 2 Train runs at once and 2
at some point; each member yields; each (trial, step) is reported once on its branch; and the bottom member
of each round copies the top. (Asynchronous PBT taking turns ran here too, 4 members for 40 steps; it went
for CI's time: 4-7 minutes on 2 cores, for the slot code this test runs already.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from search.config import load_experiment, save
from search.driver import run_experiment
from search.lineage import read_events, read_reports
from tests.ray.conftest import RUNTIME_ENV, local_ray
from tests.ray.test_pbt import lr_experiment
from trainers.metrics import read_metrics

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # ~3 min on 2 cores: 12 Train-run starts

# Three reports a member, two decision rounds (the last report decides nothing): each member yields and
# resumes twice.
INTERVAL, STEPS = 10, 30
LRS = (1e-2, 3e-3, 3e-4, 1e-4)  # the population


@pytest.fixture(scope="module")
def ray_two_cpus():
    with local_ray(RUNTIME_ENV) as ray:
        yield ray


def _time_shared(tmp: Path, corpus: Path):
    path = lr_experiment(
        tmp,
        corpus,
        "sync",
        lrs=LRS,
        population=len(LRS),
        resources={"workers": 1, "cpus_per_worker": 1.0},  # 2 fit on the 2 CPUs: half the population
        scheduler={
            "name": "pbt",
            "interval": INTERVAL,
            "burn_in": 0,  # decisions from the first report on (the default waits for half the budget)
            "quantile_fraction": 0.25,
            "synch": True,
            "resample_probability": 0.0,
        },
        budget={"steps": STEPS},
    )
    exp = load_experiment(path)
    save(exp)
    return run_experiment(exp, verbose=0)


def test_a_population_larger_than_the_cluster_takes_turns_and_exploits(ray_two_cpus, corpus_dir, tmp_path):
    result = _time_shared(tmp_path, corpus_dir)
    exp_dir = Path(result.exp_dir)
    reports, events = read_reports(exp_dir), read_events(exp_dir)
    trials = sorted({r["trial"] for r in reports})
    assert len(trials) == len(LRS) and result.finished

    # every member reaches every interval and the budget; each (trial, step) once on its current branch:
    # reported by the member, or inherited from a donor that was ahead when the member exploited it
    current = [r for r in reports if not r["abandoned"]]
    counts = Counter((r["trial"], r["step"]) for r in current)
    assert all(n == 1 for n in counts.values()), counts
    for trial in trials:
        reported = sorted(s for t, s in counts if t == trial)
        inherited = sorted(
            s for e in events if e["trial"] == trial for s in range(INTERVAL, STEPS + 1, INTERVAL) if e["from_step"] < s <= e["step"]
        )
        assert not set(reported) & set(inherited), (trial, reported, inherited)
        assert sorted(reported + inherited) == list(range(INTERVAL, STEPS + 1, INTERVAL)), (trial, reported, inherited)
        assert STEPS in reported, trial

    # the members took turns: 2 Train runs at once at most (and at some point), each member yielded
    raw = [r for p in (exp_dir / "lineage").glob("*.jsonl") for r in read_metrics(p) if r["kind"] == "report"]
    assert max(r["running"] for r in raw) == 2
    yields = Counter(r["trial"] for r in raw if r["yielded"])
    assert set(yields) == set(trials), yields
    # a yield ends the member's Train run: it resumes in a new one from the checkpoint it reported
    for trial in trials:
        runs = list((exp_dir / "runs" / trial).glob("live-*"))
        assert len(runs) >= 2, trial

    # exploits as on a full cluster: the bottom member copies the top at each round (steps 10 and 20; the
    # last report decides nothing)
    rounds = Counter(e["from_step"] for e in events)
    decided = list(range(INTERVAL, STEPS, INTERVAL))
    assert sorted(rounds) == decided and all(n >= 1 for n in rounds.values()), rounds
    for e in events:  # the exploited member continues from its donor's checkpoint at the donor's step
        assert e["donor"] != e["trial"] and e["step"] in decided
