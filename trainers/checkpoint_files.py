"""The file layout of a checkpoint (see `trainers.checkpoint`), without torch: the one place that names what
a step folder holds, for processes that only move checkpoints or read their state (Tune's actors, `raytrain`).

A committed checkpoint is a folder `step_XXXXXXXX` holding a `COMMITTED` marker; anything else under a
checkpoint root (`*.partial`, `.install-*`, `.replaced-*`) is never loaded and is cleaned up by retention.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from trainers.storage import copy_tree, list_names, local_path, location, remove_tree

__all__ = [
    "COMMITTED",
    "commit_seq",
    "committed_checkpoints",
    "DCP_METADATA",
    "DCP_MODEL_PREFIX",
    "DEEPSPEED_MODEL_STATES",
    "DEEPSPEED_PARTITION",
    "DEEPSPEED_STAGE3_MODEL",
    "DEEPSPEED_TAG",
    "DEEPSPEED_UNIVERSAL_TAG",
    "MODEL_KEY",
    "OPTIM_KEY",
    "STATE_KEY",
    "STEP_DIR",
    "TRAINER_STATE",
    "checkpoint_step",
    "delete_checkpoint",
    "is_complete",
    "link_tree",
    "read_trainer_state",
    "rng_file",
]

COMMITTED = "COMMITTED"
STEP_DIR = re.compile(r"^step_(\d{8})$")

# What a step folder holds besides COMMITTED. Every writer and reader of checkpoints (the checkpointer, the
# engines' state, `raytrain export`) takes these names from here.
TRAINER_STATE = "trainer_state.json"  # step, samples, world size, compat keys, the model section (JSON)
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index; the tensors are in *.distcp beside it
# The DCP state: {STATE_KEY: {MODEL_KEY: model state dict, OPTIM_KEY: optimizer state dict}}.
STATE_KEY, MODEL_KEY, OPTIM_KEY = "app", "model", "optim"
DCP_MODEL_PREFIX = f"{STATE_KEY}.{MODEL_KEY}."  # a model tensor's key in DCP's metadata: app.model.<fqn>
# The deepspeed engine's checkpoint: DeepSpeed's own files under the tag folder (`save_checkpoint(tag=)`).
DEEPSPEED_TAG = "deepspeed"
DEEPSPEED_UNIVERSAL_TAG = "universal"  # DeepSpeed's universal format of it, made on a resharding load
DEEPSPEED_MODEL_STATES = "mp_rank_00_model_states.pt"  # the module's weights (data-parallel rank 0's)
DEEPSPEED_PARTITION = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
DEEPSPEED_STAGE3_MODEL = "zero_pp_rank_*_model_states.pt"  # ZeRO-3: parameters partitioned too


def rng_file(rank: int) -> str:
    """The step folder's file of `rank`'s RNG state (tensors only; loaded with weights_only=True)."""
    return f"rng/rank{rank:05d}.pt"


def is_complete(path: Path) -> bool:
    """A step folder with its COMMITTED marker: locally the folder got its name by an atomic rename once
    complete; on an object store (no rename) the marker is the last object a save writes."""
    path = location(path)
    return STEP_DIR.match(path.name) is not None and (path / COMMITTED).is_file()


def committed_checkpoints(root: Any) -> list[Path]:
    """The committed step folders under `root`, the newest commit (`commit_seq`) first: the order a restore
    tries them in. Not by step: a run restored to an earlier step (a PBT exploit, a fallback past a damaged
    checkpoint) commits lower steps after higher ones, and those are its newest."""
    root = location(root)
    order = {n: (commit_seq(root / n), n) for n in list_names(root, "step_*") if STEP_DIR.match(n)}
    return [root / n for n in sorted((n for n in order if order[n][0] is not None), key=order.get, reverse=True)]


def commit_seq(path: Any) -> int | None:
    """A commit's place in its folder's order (its marker's `seq`; -1 in a marker written before the order was
    kept, which then falls back to the step); None where the folder is not committed."""
    try:
        marker = (location(path) / COMMITTED).read_text()
    except OSError:
        return None
    try:
        return int(json.loads(marker).get("seq", -1))
    except (ValueError, TypeError, AttributeError):
        return -1


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
    return json.loads((path / TRAINER_STATE).read_text())


def link_tree(src: Path, dst: Path, exclude: str | None = None) -> None:
    """Copy the folder `src` to `dst` as hard links, or as copies where the file system cannot link (another
    device); the file `exclude` (at its top) not at all. On an object store, which has no links: copies made
    by the store itself, the commit marker last."""
    if local_path(src) is None or local_path(dst) is None:
        copy_tree(location(src), location(dst), last=COMMITTED, exclude=exclude)
        return

    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    def skip(folder: str, names: list[str]) -> list[str]:
        return [exclude] if exclude in names and Path(folder) == Path(src) else []

    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, copy_function=link, ignore=skip, dirs_exist_ok=True)


def delete_checkpoint(path: Any) -> None:
    """Marker first: a folder half deleted by a crash is never taken for a checkpoint."""
    remove_tree(location(path), first=COMMITTED)
