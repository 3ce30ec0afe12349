"""What every layer shares, importing none of ours: strict pydantic models, the one-line error users see,
dotted keys, scoped environment variables, and the byte sizes users write."""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """Bad user input: one line naming the field and the fix. The CLI exits 2 on it."""


class StrictModel(BaseModel):
    """Unknown keys are errors (a misspelt key must never be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class NonFiniteLossError(RuntimeError):
    """Too many NaN/inf steps in a row; the last good checkpoint is left as it was. The CLI exits 1."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: missing or changed files, or none left to fall back to (here, not in
    `trainers.checkpoint`, so that the command line catches it without importing torch)."""


def first_line(e: BaseException) -> str:
    """An exception's message in one console line (its first, at most 300 characters)."""
    return (str(e).strip().splitlines() or [""])[0][:300]


def flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the dotted keys `--set` uses (an empty mapping stays a value)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@contextlib.contextmanager
def env_default(key: str, value: str) -> Iterator[None]:
    """`key` set to `value` for the block where the environment has no value of its own (a user's wins)."""
    with scoped_environ(**({} if key in os.environ else {key: value})):
        yield


@contextlib.contextmanager
def scoped_environ(**values: str) -> Iterator[None]:
    """`os.environ` with `values` set for the block (and the processes started in it), then as it was."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick; another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------- sizes


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float, what: str = "memory size") -> int:
    """'80GiB' -> 85899345920; '80GB' / '80G' are powers of ten; a bare number is bytes. `what` names the
    value in the error (e.g. --device-memory): a size must be at least one byte."""
    fix = "fix: write e.g. 80GiB, 40GB or 512MiB"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        size = text
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text), re.IGNORECASE)
        if not m or m.group(2).lower() not in _UNITS or not math.isfinite(float(m.group(1))):
            raise ConfigError(f"{what} {text!r} is not understood; {fix}")
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 1 <= size < math.inf:  # also NaN
        raise ConfigError(f"{what} {text!r} must be a finite size of at least 1 byte; {fix}")
    return int(size)


def checked_size(value: Any, what: str) -> str | None:
    """A config field's byte size kept as written (None stays None), checked now: a ConfigError (a ValueError)
    naming `what` and the fix, for pydantic to report before any worker starts."""
    if value is None:
        return None
    parse_bytes(value, what)
    return str(value)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
