"""What the resumable PBT keeps across `--resume` and marks at each exploit, without starting Ray."""

from __future__ import annotations

from ray import tune
from ray.train._internal.session import _TrainingResult
from ray.tune.schedulers.pbt import _PBTTrialState

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
    assert first["optimizer.lr"] in (1e-2 * 1.2, 1e-2 * 0.8) and first["member"] == 0
