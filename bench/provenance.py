"""What every benchmark JSON records about how it was made: the command, the commit, the date, the
machine's cores and its load average before and after (a busy machine is said, not hidden)."""

from __future__ import annotations

import datetime
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def provenance(started: float, load_before: tuple[float, ...]) -> dict[str, Any]:
    """`started`: time.time() when the benchmark began; `load_before`: os.getloadavg() then."""
    return {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "git_commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        "cpus": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "wall_s": time.time() - started,
    }
