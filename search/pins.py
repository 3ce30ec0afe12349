"""A trial's pins: the step folders its reports name (and the donors' it adopts), hard-linked into
`runs/<trial>/pins/` (copies by the store in a bucket) with their metadata, so that the Trainer's retention
never deletes what a report names. Named by time (a trial's steps go back when it exploits a donor behind
it); the newest `keep` stay, and any the trial still trains from (its `Place`)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.checkpoint_files import link_tree
from trainers.storage import list_names, location, remove_tree, write_json_atomic

__all__ = ["META", "PINS", "Pins", "Place", "read_meta"]

META = "meta.json"
PINS = "pins"  # in the trial's folder


def read_meta(pin: Path) -> dict[str, Any]:
    return json.loads((location(pin) / META).read_text())


@dataclass
class Place:
    """Where a trial is: the step its next interval starts from, the checkpoint it trains from (`step_dir`: in
    one of its Train runs, or in a pin), the pin its last report named, and the error its run failed with (it
    then waits to be replaced)."""

    step: int = 0
    step_dir: Path | None = None
    pin: Path | None = None
    error: str | None = None

    @classmethod
    def at(cls, point: dict[str, Any]) -> Place:
        """A lineage log's resume point (`LineageLog.resume_point`): a report's or an exploit's pin, or a failure."""
        pin = location(point["pin"]) if "pin" in point else None
        return cls(point["step"], pin / read_meta(pin)["step_dir"] if pin else None, pin, point.get("error"))

    def in_use(self) -> tuple[Path | None, ...]:
        """What the trial trains from: its pins keep these."""
        return self.pin, self.step_dir.parent if self.step_dir else None

    def meta(self, trial: str, hparams: dict[str, Any], metric: float | None) -> dict[str, Any]:
        """A pin's metadata, of a report at this place."""
        step_dir = self.step_dir.name if self.step_dir else None
        return {"trial": trial, "step": self.step, "time": time.time(), "hparams": hparams, "metric": metric,
                "step_dir": step_dir}


class Pins:
    def __init__(self, trial_dir: Path, keep: int) -> None:
        self.root, self.keep = trial_dir / PINS, keep

    def make(self, step_dir: Path, meta: dict[str, Any], in_use: Iterable[Path | None] = ()) -> Path:
        """A new pin of `step_dir` with `meta` (written last: a pin with its metadata is whole)."""
        pin = self.root / f"{time.time_ns():020d}-{step_dir.name}-{uuid.uuid4().hex[:6]}"
        link_tree(step_dir, pin / step_dir.name)
        write_json_atomic(pin / META, meta, indent=None)
        self.prune(pin, *in_use)
        return pin

    def adopt(self, donor_pin: Path, in_use: Iterable[Path | None] = ()) -> tuple[Path, dict[str, Any]]:
        """A donor's pin made one of this trial's, and its metadata (which still names the donor's trial and
        step). FileNotFoundError when the donor pruned it already."""
        meta = read_meta(donor_pin)
        return self.make(donor_pin / meta["step_dir"], meta, in_use), meta

    def prune(self, *in_use: Path | None) -> None:
        """Beyond the newest `keep` pins, the older go (whole ones: a pin without its metadata is one a crash
        cut short, never named by a log row), but for those `in_use` names."""
        names = sorted(n for n in list_names(self.root) if n[:1].isdigit())
        stay = {p.name for p in in_use if p is not None}
        for name in names[: max(len(names) - self.keep, 0)]:
            if name not in stay:
                remove_tree(self.root / name, first=META)
