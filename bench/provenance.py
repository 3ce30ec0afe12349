"""What every benchmark JSON records about how it was made: the command, the commit and whether the tree was
dirty, the date, the versions of Python, torch, Ray, torchft and DeepSpeed, the machine's cores and its load
average before and after (a busy machine is said, not hidden), and the paths of the repository whose code the
figure measures (`measures`: bench/stale.py lists a result whose paths changed since its commit).

The commit (`git_state`): a GPU machine lent for a session may hold a copy of `.git` older than the tree it
was sent (seen: its HEAD stayed at the session's first commit while later trees ran), so the caller can name
it: `BENCH_GIT_COMMIT=<sha>` in the remote command, the sha taken where the tree was sent from. Then
`git_dirty` is None (unknown there) and `git_commit_source` says where the commit came from."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


# The libraries whose versions every result records (distribution names; None where one is not installed).
VERSIONED = ("torch", "ray", "torchft", "deepspeed")


def provenance(started: float, load_before: tuple[float, ...], *, measures: list[str] | None = None) -> dict[str, Any]:
    """`started`: time.time() when the benchmark began; `load_before`: os.getloadavg() then; `measures`: the
    repository paths (files or folders, relative to its root) whose code the figure measures: bench/stale.py
    calls the result stale once one of them changes after its commit. A path that does not exist is refused
    (a typo would hide every later change)."""
    missing = [m for m in measures or () if not (ROOT / m).exists()]
    if missing:
        raise ValueError(f"provenance(measures=...): no such path in {ROOT}: {', '.join(missing)}")
    return {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        **git_state(),
        "git_dirty_paths": dirty_paths(),
        "versions": versions(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.time() - started,
        "measures": sorted(measures) if measures is not None else None,
    }


def dirty_paths() -> list[str] | None:
    """The paths with uncommitted changes (untracked ones too) in this checkout; None where unknown (no git,
    or BENCH_GIT_COMMIT names the commit: this .git is not the tree that ran). bench/stale.py calls a result
    made with a measured path among them stale."""
    if os.environ.get("BENCH_GIT_COMMIT", "").strip():
        return None
    changed, untracked = _git("diff", "--name-only", "HEAD"), _git("ls-files", "--others", "--exclude-standard")
    if changed is None or untracked is None:
        return None
    return sorted({*changed.splitlines(), *untracked.splitlines()})


def versions() -> dict[str, str | None]:
    """{"python", "torch", "ray", "torchft", "deepspeed"}: the installed versions, read from the packages'
    metadata (nothing is imported: Ray and DeepSpeed take seconds); None for one not installed."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_state() -> dict[str, Any]:
    """{"git_commit", "git_dirty", "git_commit_source"}: BENCH_GIT_COMMIT if set, else this checkout's
    (None where there is no git or no .git)."""
    named = os.environ.get("BENCH_GIT_COMMIT", "").strip()
    if named:
        return {"git_commit": named, "git_dirty": None, "git_commit_source": "BENCH_GIT_COMMIT"}
    commit, dirty = _git("rev-parse", "HEAD"), _git("status", "--porcelain")
    return {"git_commit": commit or None, "git_dirty": None if dirty is None else bool(dirty),
            "git_commit_source": "git" if commit else None}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
