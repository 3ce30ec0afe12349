"""A trial's pins: the step folders its reports name (and the donors' it adopts in an exploit), hard-linked
into the trial's folder (`runs/<trial>/pins/`, copies by the store in a bucket), each with its metadata
beside it, so that the Trainer's own retention never deletes what a report names. Named in the order they
are made (the time first: a trial's steps go back when it exploits a donor behind it); the newest `keep` stay,
and any the trial still trains from."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainers.checkpoint_files import link_tree
from trainers.storage import list_names, location, remove_tree, write_json_atomic

__all__ = ["META", "PINS", "Pins", "read_meta"]

META = "meta.json"
PINS = "pins"  # in the trial's folder


def read_meta(pin: Path) -> dict[str, Any]:
    return json.loads((location(pin) / META).read_text())


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
