"""Shared config base: strict pydantic models and the one-line error users see."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """Bad user input: one line naming the field and the fix. The CLI exits 2 on it."""


class StrictModel(BaseModel):
    """Unknown keys are errors (a misspelt key must never be silently ignored)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class NonFiniteLossError(RuntimeError):
    """Too many NaN/inf steps in a row; the last good checkpoint is left as it was. The CLI exits 1."""
