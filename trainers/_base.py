"""Shared config base: strict pydantic models and the one-line error users see."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """Bad user input: one line naming the field and the fix. The CLI exits 2 on it."""


class StrictModel(BaseModel):
    """Unknown keys are errors (a misspelt key must never be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class NonFiniteLossError(RuntimeError):
    """Too many NaN/inf steps in a row; the last good checkpoint is left as it was. The CLI exits 1."""


def first_line(e: BaseException) -> str:
    """An exception's message in one console line (its first, at most 300 characters)."""
    return (str(e).strip().splitlines() or [""])[0][:300]


def flat_keys(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: the dotted keys `--set` and one-line errors use (an empty mapping
    stays a value)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
