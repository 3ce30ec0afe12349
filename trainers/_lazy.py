"""A package whose public names load on first use: importing it imports none of their modules (torch among them)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """The package's module-level `__getattr__` and `__dir__` (PEP 562) for `exports`, public name -> the module
    that defines it: `__getattr__, __dir__ = lazy_names(globals(), _EXPORTS)`."""

    def __getattr__(name: str) -> Any:
        if name not in exports:  # a submodule (`from pkg import mod`) is then imported as one
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value  # the next lookup is a plain one
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *namespace.get("__all__", ())})

    return __getattr__, __dir__
