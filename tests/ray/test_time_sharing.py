"""PBT with a population larger than the cluster holds (issue 25): 4 members (synchronous) or 3
(asynchronous), each a Train run of 1 worker of 1 CPU, on a local Ray of 2 CPUs. Members take turns at
the 2 slots (`search.slots`), yielding at report boundaries, so every member reaches every interval and PBT
exploits as on a full cluster (before, Tune's concurrency limit ran the members one after another: 0
exploits).

Asynchronous and synchronous PBT: every member reaches the budget; at most 2 Train runs at once and 2 at
some point; each member yields; each (trial, step) is reported once on its branch; and exploits happen
(synchronous: the bottom member of each round copies the top; asynchronous: at least one, as each member
is decided on when it reports)."""

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

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # 3-4 min each on 2 cores: 9-12 Train-run starts

# Three reports a member, two decision rounds (the last report decides nothing): each member yields and
# resumes twice.
INTERVAL, STEPS = 10, 30
LRS = {True: (1e-2, 3e-3, 3e-4, 1e-4), False: (1e-2, 3e-4, 1e-4)}  # by `synch`: the population


@pytest.fixture(scope="module")
def ray_two_cpus():
    with local_ray(RUNTIME_ENV) as ray:
        yield ray


def _time_shared(tmp: Path, corpus: Path, synch: bool):
    name = "sync" if synch else "async"
    path = lr_experiment(
        tmp,
        corpus,
        name,
        lrs=LRS[synch],
        population=len(LRS[synch]),
        resources={"workers": 1, "cpus_per_worker": 1.0},  # 2 fit on the 2 CPUs: half the population
        scheduler={
            "name": "pbt",
            "interval": INTERVAL,
            "burn_in": 0,  # decisions from the first report on (the default waits for half the budget)
            "quantile_fraction": 0.5 if not synch else 0.25,
            "synch": synch,
            "resample_probability": 0.0,
        },
        budget={"steps": STEPS},
    )
    exp = load_experiment(path)
    save(exp)
    return run_experiment(exp, verbose=0)


@pytest.mark.parametrize("synch", [False, True], ids=["async", "sync"])
def test_a_population_larger_than_the_cluster_takes_turns_and_exploits(ray_two_cpus, corpus_dir, tmp_path, synch):
    result = _time_shared(tmp_path, corpus_dir, synch)
    exp_dir = Path(result.exp_dir)
    reports, events = read_reports(exp_dir), read_events(exp_dir)
    trials = sorted({r["trial"] for r in reports})
    assert len(trials) == len(LRS[synch]) and result.finished

    # every member reaches every interval and the budget; each (trial, step) once on its current branch:
    # reported by the member, or inherited from a donor that was ahead when the member exploited it
    # (asynchronous PBT: a member that waited for a slot may copy a checkpoint past its own step)
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

    # exploits as on a full cluster: synchronous PBT's bottom member copies the top at each round
    # (steps 10 and 20; the last report decides nothing); asynchronous PBT decides each member when it
    # reports, so at least one exploit in all (the weakest member, 1e-4, is the bottom one when it reports
    # step 10 after the two others did) and donors only from the top
    rounds = Counter(e["from_step"] for e in events)
    decided = list(range(INTERVAL, STEPS, INTERVAL))
    if synch:
        assert sorted(rounds) == decided and all(n >= 1 for n in rounds.values()), rounds
    else:
        assert len(events) >= 1, rounds
    for e in events:  # the exploited member continues from its donor's checkpoint at the donor's step
        assert e["donor"] != e["trial"] and e["step"] in decided
