"""The file layout of a checkpoint (see `trainers.checkpoint`), without torch: what a process that only
moves checkpoints needs (a Tune trial's actor pins and installs them; `raytrain` reads their state).

A committed checkpoint is a folder `step_XXXXXXXX` holding a `COMMITTED` marker; anything else under a
checkpoint root (`*.partial`, `.install-*`, `.replaced-*`) is never loaded and is cleaned up by retention.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from trainers.storage import copy_tree, is_remote, location, remove_tree

__all__ = [
    "COMMITTED",
    "STEP_DIR",
    "checkpoint_step",
    "delete_checkpoint",
    "install_checkpoint",
    "is_complete",
    "link_tree",
    "read_trainer_state",
]

COMMITTED = "COMMITTED"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def is_complete(path: Path) -> bool:
    """A step folder with its COMMITTED marker: locally the folder got its name by an atomic rename once
    complete; on an object store (no rename) the marker is the last object a save writes."""
    path = location(path)
    return STEP_DIR.match(path.name) is not None and (path / COMMITTED).is_file()


def checkpoint_step(path: Any) -> int:
    """The step a checkpoint folder holds, from its name (`step_00000040` -> 40)."""
    match = STEP_DIR.match(location(path).name)
    if match is None:
        raise ValueError(f"{path} is not a step_XXXXXXXX checkpoint folder")
    return int(match.group(1))


def read_trainer_state(path: Path) -> dict[str, Any]:
    path = location(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMMITTED} marker)")
    return json.loads((path / "trainer_state.json").read_text())


def link_tree(src: Path, dst: Path) -> None:
    """Copy the folder `src` to `dst` as hard links (the same files, no data copied), file by file as
    copies where the file system cannot link (another device). On an object store, which has no links:
    copies made by the store itself (the bytes do not pass through this machine), the commit marker last."""
    if is_remote(src) or is_remote(dst):
        copy_tree(location(src), location(dst), last=COMMITTED)
        return

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, copy_function=link)


def install_checkpoint(root: Path, src: Path) -> Path:
    """Make the committed checkpoint `src` (a PBT donor's) the newest under the checkpoint root `root`, at
    its step's name: hard links, then the root's own checkpoints at that step or later go, so that a restart
    resumes from it. Not collective: one process calls it while the run's workers wait. A crash leaves the
    old newest or the installed one, never a half-made step folder (staging is not named like one).

    On an object store (no rename) as a save there is made: the checkpoints at that step or later are
    deleted (marker first), the donor's files copied in by the store, its marker last. A crash in between
    leaves the run's older checkpoints, never a half-made one that loads."""
    root, src = location(root), location(src)
    step = int(read_trainer_state(src)["step"])
    final = root / f"step_{step:08d}"
    if is_remote(root):
        for name in sorted({p.name for p in root.glob("step_*")} if root.exists() else ()):
            match = STEP_DIR.match(name)
            if match and int(match.group(1)) >= step:
                delete_checkpoint(root / name)
        link_tree(src, final)
        if not (final / COMMITTED).is_file():  # the donor's marker is copied last: its absence is a bug
            raise FileNotFoundError(f"{final}: {COMMITTED} missing after the copy of {src}")
        return final
    tag = uuid.uuid4().hex[:8]
    staging = root / f".install-{final.name}-{tag}"
    root.mkdir(parents=True, exist_ok=True)
    link_tree(src, staging)
    _fsync_dir(staging)
    aside = []
    for old in sorted(root.glob("step_*")):
        match = STEP_DIR.match(old.name)
        if match and int(match.group(1)) >= step:
            aside.append(old.rename(root / f".replaced-{old.name}-{tag}"))
    os.replace(staging, final)
    _fsync_dir(root)
    for old in aside:
        shutil.rmtree(old, ignore_errors=True)
    return final


def delete_checkpoint(path: Any) -> None:
    """Marker first: a folder half deleted by a crash is never taken for a checkpoint."""
    if is_remote(path):
        try:
            path.fs.rm_file((path / COMMITTED).path)
        except FileNotFoundError:
            pass
    remove_tree(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
