"""Population-based training of runs on Ray Tune. From Python: `tune(experiment) -> ExperimentResult`
(docs/python-api.md); the command is `raytrain tune` (`search.cli`)."""

from search.api import ExperimentResult, TrialResult, tune

__all__ = ["ExperimentResult", "TrialResult", "tune"]
