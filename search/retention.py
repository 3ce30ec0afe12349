"""Tune checkpoint retention (and of the pins they point at) that never deletes a checkpoint a pending
exploit needs.

Tune's own `num_to_keep` deletes a trial's older checkpoints as new ones arrive, also the one PBT has just
picked for another trial to clone, before that trial restarts (ray #9036: `num_to_keep <= 2` breaks PBT;
under time-multiplexing any small value can). Here each trial keeps its newest `keep` checkpoints, plus
every checkpoint still referenced by a trial as the one it will restore from (an exploit points the
exploited trial at the donor's) or by the scheduler as a donor candidate.

Tune's checkpoints are read and deleted through their own file system (an experiment in a bucket: the
bucket's), the pins through their locations.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ray import tune

from raytrain_ext import ray_compat
from trainers.storage import location, location_on, remove_tree

__all__ = ["ProtectedRetention", "to_delete"]


def to_delete(checkpoints: list[str], keep: int, protected: Iterable[str]) -> list[str]:
    """Of one trial's checkpoints (oldest first), those beyond the newest `keep` that nothing protects."""
    protected = set(protected)
    old = checkpoints[: max(len(checkpoints) - keep, 0)]
    return [c for c in old if c not in protected]


class ProtectedRetention(tune.Callback):
    """Prunes Tune's checkpoints (metadata only, see search/trial.py) and the pins they point at: each
    trial keeps its newest `keep` of each, plus whatever a restore or a pending exploit still needs."""

    def __init__(self, keep: int, scheduler: Any = None):
        self.keep, self.scheduler = keep, scheduler

    def on_checkpoint(
        self, iteration: int, trials: list[Any], trial: Any, checkpoint: Any, **info: Any
    ) -> None:
        self.fs = checkpoint.filesystem  # every checkpoint of the experiment is on this one
        protected = self._protected(trials)
        if protected is None:  # a donor's save is still pending: decide at the next checkpoint
            return
        for t in trials:
            # Tune calls this before it registers `checkpoint`, the trial's newest: it counts towards `keep`.
            kept = self.keep - 1 if t is trial else self.keep
            doomed = set(to_delete(ray_compat.trial_checkpoints(t), kept, protected))
            if not doomed:
                continue
            ray_compat.forget_trial_checkpoints(t, doomed)
            for path in doomed:
                _delete(self.fs, path)
        self._prune_pins(trials, protected | {checkpoint.path})

    def _prune_pins(self, trials: list[Any], protected: set[str]) -> None:
        """A pin goes once no Tune checkpoint left points at it, nothing protects it, and it is not among
        its trial's newest `keep` (the newest may be about to be saved)."""
        needed = {_pin_of(self.fs, p) for p in protected} | {
            _pin_of(self.fs, path) for t in trials for path in ray_compat.trial_checkpoints(t)
        }
        roots = {str(location(p).parent): location(p).parent for p in needed if p is not None}
        for root in roots.values():
            pins = sorted(root.iterdir(), key=_pin_age)
            for pin in to_delete([str(p) for p in pins], self.keep, needed):
                remove_tree(location(pin))

    def _protected(self, trials: list[Any]) -> set[str] | None:
        """Paths a restore may still need, or None while the scheduler waits on a save in flight."""
        paths = set()
        for t in trials:
            latest = t.run_metadata.checkpoint_manager.latest_checkpoint_result
            if latest is not None and latest.checkpoint is not None:
                paths.add(latest.checkpoint.path)
        donors = getattr(self.scheduler, "donor_candidates", list)  # PBT/PB2 (search.schedulers)
        for candidate in donors():
            path = _donor_path(candidate)
            if path is _PENDING:
                return None
            if path is not None:
                paths.add(path)
        return paths


def _pin_of(fs: Any, path: str) -> str | None:
    """The pin a Tune checkpoint's metadata points at (a pin is its own), None for an older full checkpoint."""
    try:
        with fs.open_input_stream(f"{path.rstrip('/')}/meta.json") as f:
            meta = json.loads(f.read())
    except (OSError, ValueError):
        return None
    if "pin" in meta:
        return meta["pin"]
    here = location_on(fs, path)
    return str(here) if here.parent.name == "pins" else None


def _delete(fs: Any, path: str) -> None:
    try:
        fs.delete_dir(path)
    except (FileNotFoundError, OSError):  # gone already (pyarrow raises OSError subclasses for a missing one)
        pass


def _pin_age(pin: Any) -> tuple[int, float, str]:
    """Sorts pins oldest first: by name, which starts with the time it was made (search.trial); a pin made
    before names did (an experiment resumed across versions) first, by its folder's mtime."""
    if pin.name[:1].isdigit():
        return 1, 0.0, pin.name
    try:
        return 0, pin.stat().st_mtime, pin.name
    except OSError:
        return 0, 0.0, pin.name


_PENDING = object()


def _donor_path(candidate: Any) -> Any:
    """A scheduler's donor checkpoint: a Checkpoint, or (async PBT) the future of a save that may still
    be running; _PENDING when it cannot be known yet."""
    if candidate is None or isinstance(candidate, tune.Checkpoint):
        return candidate.path if candidate is not None else None
    future = getattr(candidate, "future", None)
    if future is None:
        return _PENDING
    import ray

    ready, _ = ray.wait([future], timeout=0)
    if not ready:
        return _PENDING
    try:
        result = ray.get(future)
    except Exception:  # the save failed: PBT will find no checkpoint to clone either
        return None
    checkpoint = getattr(result, "checkpoint", None)
    return checkpoint.path if checkpoint is not None else None
