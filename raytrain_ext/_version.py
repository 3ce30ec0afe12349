"""The version `raytrain --version` prints and `raytrain_ext.__version__` holds."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "raytrain-ext"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

__all__ = ["DISTRIBUTION", "__version__", "package_version"]


def package_version() -> str:
    """The installed distribution's version; a source tree on PYTHONPATH that was never installed (a bare GPU
    machine's) reads pyproject.toml's."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        text = PYPROJECT.read_text() if PYPROJECT.is_file() else ""
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
        return found.group(1) if found else "0+unknown"


__version__ = package_version()
