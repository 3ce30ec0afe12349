"""What the resumable PBT keeps across `--resume` and marks at each exploit, without starting Ray."""

from __future__ import annotations

import logging
import math
import random
import warnings

import numpy as np
import pytest
from ray import tune
from ray.train._internal.checkpoint_manager import _CheckpointManager
from ray.train._internal.session import _TrainingResult
from ray.tune.schedulers.pb2 import PB2  # noqa: F401  (scikit-learn sets KMP_* variables on import: at collection)
from ray.tune.schedulers.pbt import _PBTTrialState

from raytrain_ext import ray_compat
from search.console import quiet_warnings
from search.schedulers import EXPLOIT_ID, SchedulerConfig, build_scheduler
from search.space import parse_space

SPACE = parse_space({"optimizer.lr": {"loguniform": [1e-4, 1e-2]}})


def _pbt():
    return build_scheduler(SchedulerConfig(name="pbt", interval=10, quantile_fraction=0.5), SPACE, 40)


class _Trial:  # what PBT reads of a Tune trial here (hashable: PBT keys its state by trial)
    def __init__(self, trial_id: str, lr: float):
        self.trial_id = self.experiment_tag = trial_id
        self.config = {"member": 0, "optimizer.lr": lr}


class _SaveDone:
    """The future of a save that PBT asked a top trial for (ray.train's _FutureTrainingResult), finished."""

    def __init__(self, result: _TrainingResult):
        self.result = result

    def resolve(self, block: bool = True) -> _TrainingResult:
        return self.result


def test_a_donors_finished_save_is_exported_as_its_checkpoint(tmp_path):
    pbt = _pbt()
    donor = _Trial("a", 1e-2)
    state = pbt._trial_state[donor] = _PBTTrialState(donor)
    saved = tune.Checkpoint.from_directory(str(tmp_path))
    state.last_checkpoint = _SaveDone(_TrainingResult(saved, {"val_loss": 2.0, "step": 20}))
    exported = pbt.export_state()["trials"]["a"]
    # exported as None (the future cannot be pickled), a resumed PBT found no checkpoint to clone and
    # skipped every exploit of this donor until its next perturbation
    assert exported["last_checkpoint"].path == saved.path
    assert exported["last_result"] == {"val_loss": 2.0, "step": 20}


def test_each_exploit_gets_its_own_id_in_the_new_config():
    pbt = _pbt()
    weak, strong = _Trial("b", 1e-4), _Trial("a", 1e-2)
    first, _ = pbt._get_new_config(weak, strong)
    again, _ = pbt._get_new_config(weak, strong)
    # the id lets the exploited trial record the decision once, however often Tune restores it
    assert first[EXPLOIT_ID] != again[EXPLOIT_ID] and len(first[EXPLOIT_ID]) == 32
    assert first["optimizer.lr"] == pytest.approx(5e-3) and first["member"] == 0  # x 0.5, or x 2 folded back


def test_recipients_of_one_donor_never_share_a_configuration_in_a_round():
    """The donor sits at a bound of both keys (lr at its top, weight decay at 0): every perturbation of it
    clips to few values, and without a re-draw two recipients of one round trained the same configuration
    for the rest of the run (`make demo` before issue 25: both at lr x1.2, weight decay 0)."""
    space = parse_space({"optimizer.lr": {"loguniform": [1e-4, 1e-2]}, "optimizer.weight_decay": {"uniform": [0.0, 0.2]}})
    for seed in range(20):
        cfg = SchedulerConfig(name="pbt", interval=10, quantile_fraction=0.5, resample_probability=0.1)
        pbt = build_scheduler(cfg, space, 40, seed=seed)
        donor = _Trial("donor", 1e-2)
        donor.config["optimizer.weight_decay"] = 0.0
        recipients = [_Trial(f"r{i}", 1e-4) for i in range(3)]
        for t in (donor, *recipients):
            pbt._trial_state[t] = _PBTTrialState(t)
        given = []
        for r in recipients:  # one exploit round: each recipient explores the same donor in turn
            new, _ = pbt._get_new_config(r, donor)
            r.config = new  # as PBT's exploit sets it (set_config), before the next recipient's explore
            given.append((new["optimizer.lr"], new["optimizer.weight_decay"]))
        held = given + [(1e-2, 0.0)]
        assert len(set(held)) == len(held), f"seed {seed}: {given}"


def test_a_space_with_no_unused_configuration_left_still_explores():
    space = parse_space({"model.kind": {"choice": ["a", "b"]}})
    pbt = build_scheduler(SchedulerConfig(name="pbt", interval=10), space, 40, seed=0)
    members = [_Trial(f"t{i}", 1e-3) for i in range(4)]
    for t, kind in zip(members, "abab"):
        t.config["model.kind"] = kind
        pbt._trial_state[t] = _PBTTrialState(t)
    new, _ = pbt._get_new_config(members[1], members[0])  # every value is held: the last draw is kept
    assert new["model.kind"] in ("a", "b")


# ---------------------------------------------------------------------------------------- PB2


def _pb2_proposals(space_raw: dict, best_log10_lr: float, proposals: int = 4) -> list[dict]:
    """PB2 fed five reports of six trials whose loss falls fastest at lr = 10**best_log10_lr; then the two
    bottom trials explore from one donor, `proposals` times in one round."""
    np.random.seed(0)  # PB2's GP and its acquisition's optimiser draw from numpy's global generator
    random.seed(0)
    pb2 = build_scheduler(SchedulerConfig(name="pb2", interval=10), parse_space(space_raw), 100)
    pb2.set_search_properties("val_loss", "min")
    trials = [_Trial(f"t{i}", lr) for i, lr in enumerate((3e-4, 6e-4, 1.5e-3, 4e-3, 1e-2, 2.5e-2))]
    for i, t in enumerate(trials):
        t.config.update({"member": i, "train.accum": 4})
        pb2._trial_state[t] = _PBTTrialState(t)
    loss = dict.fromkeys(trials, 3.0)
    for step in range(10, 60, 10):
        for t in trials:
            loss[t] -= 0.1 * math.exp(-((math.log10(t.config["optimizer.lr"]) - best_log10_lr) ** 2))
            pb2._save_trial_state(pb2._trial_state[t], step, {"val_loss": loss[t], "step": step}, t)
    return [pb2._get_new_config(trials[k % 2], trials[3])[0] for k in range(proposals)]


@pytest.mark.parametrize(("best", "decade"), [(-3.2, (3e-4, 1e-3)), (-2.5, (1e-3, 1e-2)), (-1.8, (1e-2, 3e-2))])
def test_pb2_searches_a_log_uniform_range_in_log_space(best, decade):
    """Ray's PB2 normalises its bounds linearly: over [3e-4, 3e-2] the lowest decade is 0.7% of the box
    (it proposed 3e-3..3e-2 where the data pointed to 6e-4). On the log scale its proposals go to the decade
    the data favour, whichever it is, and come back as the space's own values (a logint as an int)."""
    space = {"optimizer.lr": {"loguniform": [3e-4, 3e-2]}, "train.accum": {"logint": [1, 64]}}
    for new in _pb2_proposals(space, best):
        assert decade[0] <= new["optimizer.lr"] < decade[1], (best, new)
        assert isinstance(new["train.accum"], int) and 1 <= new["train.accum"] <= 64
        assert new["member"] in (0, 1, 2, 3, 4, 5)


def test_pb2_decides_without_scikit_learns_convergence_warnings():
    """Its GP, fit on a few noisy points, hits a kernel bound at most decisions: each one printed a
    ConvergenceWarning on the console of `raytrain tune` that a user cannot act on (the driver runs Tune
    under `quiet_warnings`)."""
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ConvergenceWarning)
        with quiet_warnings():
            proposals = _pb2_proposals({"optimizer.lr": {"loguniform": [3e-4, 3e-2]}}, -2.5)
    assert len(proposals) == 4
    assert not [w for w in seen if issubclass(w.category, ConvergenceWarning)], [str(w.message) for w in seen]


def test_tunes_upload_that_raced_a_save_of_its_state_prints_no_traceback(tmp_path, caplog):
    """Stop 49's CI: on a Ctrl-C, Tune's final save of its experiment state logged, with a traceback, the
    failure of the previous upload of its staging folder, which had listed the searcher's temp file before
    the save renamed it (the save's own upload follows). Left out under `quiet_warnings`, and only that
    error: another failure of the upload (a file of the state itself missing) is still shown."""
    import pyarrow.fs

    log = logging.getLogger(ray_compat.EXPERIMENT_STATE_LOGGER)
    local = pyarrow.fs.LocalFileSystem()

    def upload_fails_on(name: str) -> None:
        try:  # the copy Ray's syncer makes (ray/train/_internal/storage.py), of a file gone since listed
            pyarrow.fs.copy_files(str(tmp_path / name), str(tmp_path / "storage" / name), local, local)
        except FileNotFoundError:
            log.error("Saving experiment state to storage at '%s' failed with exception: ", tmp_path, exc_info=True)

    rays = ".d7514445-tmp-basic-variant-state-2026-11-27_23-00-34.json"  # ray/tune/utils/util.py _atomic_save
    ours = ".scheduler_state.json.15524.a1b2c3"  # SchedulerState's summary, trainers.storage.write_bytes_atomic
    state = "experiment_state-2026-11-27_23-00-34.json"
    with caplog.at_level(logging.ERROR, logger=ray_compat.EXPERIMENT_STATE_LOGGER):
        with quiet_warnings():
            upload_fails_on(rays)
            upload_fails_on(ours)
            upload_fails_on(state)
        upload_fails_on(rays)  # outside it, Ray's logging as it was
    shown = [str(r.exc_info[1]) for r in caplog.records]
    assert len(shown) == 2 and state in shown[0] and rays in shown[1], shown
    assert not log.filters


# ----------------------------------------------------------------------------------- in place


class _LiveTrial(_Trial):
    def __init__(self, trial_id: str, lr: float):
        super().__init__(trial_id, lr)
        self.status = "RUNNING"
        self.run_metadata = type("Meta", (), {"checkpoint_manager": _CheckpointManager(tune.CheckpointConfig())})()

    def set_config(self, config):
        self.config = config

    def set_experiment_tag(self, tag):
        self.experiment_tag = tag

    def is_finished(self):
        return False

    def __str__(self):
        return self.trial_id


class _Controller:
    search_alg = None

    def __init__(self, trials):
        self.trials = trials

    def get_trials(self):
        return self.trials

    def get_live_trials(self):
        return self.trials


def _in_place(synch: bool, timeout: float = 900.0):
    cfg = SchedulerConfig(
        name="pbt", interval=10, burn_in=0, quantile_fraction=0.34, synch=synch, sync_timeout_s=timeout
    )
    pbt = build_scheduler(cfg, SPACE, 40)
    pbt.set_search_properties("val_loss", "min")
    pbt.attach("board")
    posted = []
    pbt._post = lambda trial, step, decision: posted.append((trial.trial_id, step, decision))
    trials = [_LiveTrial(f"t{i}", lr) for i, lr in enumerate((1e-2, 1e-3, 1e-4))]
    controller = _Controller(trials)
    for t in trials:
        pbt.on_trial_add(controller, t)
    return pbt, controller, trials, posted


def _result(trial, step, loss, tmp_path):
    return {"val_loss": loss, "step": step, "pin": str(tmp_path / trial.trial_id / f"pin{step}")}


def test_synchronous_in_place_pbt_holds_members_live_and_decides_when_all_are_there(tmp_path):
    pbt, controller, (best, mid, worst), posted = _in_place(synch=True)
    for trial, loss in ((worst, 5.0), (best, 3.0)):
        assert pbt.on_trial_result(controller, trial, _result(trial, 10, loss, tmp_path)) == "CONTINUE"
    assert posted == [], "no decision while a member is missing: the others wait at their gates, live"
    assert pbt.on_trial_result(controller, mid, _result(mid, 10, 4.0, tmp_path)) == "CONTINUE"
    decisions = {trial: decision for trial, step, decision in posted if step == 10}
    assert decisions["t0"] == decisions["t1"] == "go"
    order = decisions["t2"]
    assert order["pin"] == str(tmp_path / "t0" / "pin10"), "the best member's report is the donor"
    assert worst.config[EXPLOIT_ID] == order["exploit_id"] and worst.config["optimizer.lr"] != 1e-4
    assert pbt._num_perturbations == 1


def test_a_synchronous_round_goes_on_without_a_member_past_its_timeout(tmp_path):
    pbt, controller, (best, mid, worst), posted = _in_place(synch=True, timeout=60.0)
    for trial, loss in ((worst, 5.0), (best, 3.0)):
        pbt.on_trial_result(controller, trial, _result(trial, 10, loss, tmp_path))
    pbt.tick()
    assert posted == [], "within the timeout: still waiting for the third member"
    pbt._first_wait -= 61.0  # the round started 61 s ago (the clock the scheduler reads)
    pbt.tick()
    assert {trial for trial, step, _ in posted if step == 10} == {"t0", "t2"}
    # the member that hung reports late: decided alone at once, not held for a round that has passed
    pbt.on_trial_result(controller, mid, _result(mid, 10, 4.0, tmp_path))
    assert [trial for trial, _, _ in posted] == ["t0", "t2", "t1"]


def test_asynchronous_in_place_pbt_decides_each_report_at_once(tmp_path):
    pbt, controller, (best, mid, worst), posted = _in_place(synch=False)
    assert pbt.on_trial_result(controller, best, _result(best, 10, 3.0, tmp_path)) == "CONTINUE"
    assert pbt.on_trial_result(controller, mid, _result(mid, 10, 4.0, tmp_path)) == "CONTINUE"
    assert pbt.on_trial_result(controller, worst, _result(worst, 10, 5.0, tmp_path)) == "CONTINUE"
    # each decided against the members that have reported so far: the first alone (go), the second as
    # the worse of two, the third as the worst of three (both exploit the best one's report)
    assert [(t, s) for t, s, _ in posted] == [("t0", 10), ("t1", 10), ("t2", 10)]
    assert posted[0][2] == "go"
    assert posted[1][2]["pin"] == posted[2][2]["pin"] == str(tmp_path / "t0" / "pin10")


def test_ray_pbt_internals_that_in_place_exploits_rely_on():
    """Pins Ray 2.60's PBT internals that search.schedulers.InPlace uses: fails when an upgrade changes them."""
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.tune.execution.tune_controller import TuneController  # noqa: F401
    from ray.tune.schedulers.pbt import PopulationBasedTraining, _make_experiment_tag  # noqa: F401

    pbt = PopulationBasedTraining(time_attr="step", perturbation_interval=10, hyperparam_mutations={"a": [1, 2]})
    for name in ("_burn_in_period", "_perturbation_interval", "_synch", "_next_perturbation_sync", "_metric"):
        assert hasattr(pbt, name), name
    for name in ("_save_trial_state", "_quantiles", "_get_new_config", "_trial_state", "_hyperparam_mutations"):
        assert hasattr(pbt, name), name
    manager = _CheckpointManager(None)
    assert hasattr(manager, "_checkpoint_results")  # search.retention


def test_the_status_line_counts_the_exploits_decided_as_the_console_lists_them():
    pbt = _pbt()
    weak, strong = _Trial("b", 1e-4), _Trial("a", 1e-2)
    pbt._get_new_config(weak, strong)
    pbt._get_new_config(_Trial("c", 1e-4), strong)
    # decided twice, loaded by no trial yet (Ray's line read "0 perturbs" here, under two exploit lines)
    assert pbt.debug_string() == "PBT: 2 exploits (2 not yet loaded)"
    pbt._num_perturbations = 2  # both trials reported after loading theirs (InPlace._adopt_trial_log)
    assert pbt.debug_string() == "PBT: 2 exploits"
    restored = _pbt()
    restored.import_state(pbt.export_state())
    assert restored.debug_string() == "PBT: 2 exploits"


def test_pbt_burn_in_is_half_the_budget_by_default_or_steps_or_a_share():
    """bench/results/pbt_quality.json chose the default: no exploit before half of each trial's steps."""
    cfg = SchedulerConfig(name="pbt", interval=10)
    assert cfg.burn_in_steps(1600) == 800
    assert build_scheduler(cfg, SPACE, 40)._burn_in_period == 20
    assert SchedulerConfig(name="pbt", burn_in="25%").burn_in_steps(1600) == 400
    assert SchedulerConfig(name="pbt", burn_in=30).burn_in_steps(1600) == 30
    assert SchedulerConfig(name="pb2", interval=10).burn_in_steps(1600) == 0  # pb2 decides from its first report
    for bad in ("half", "100%", "-5%"):
        with pytest.raises(ValueError, match="neither a step count nor a share"):
            SchedulerConfig(name="pbt", burn_in=bad)
