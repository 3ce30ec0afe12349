"""Data section of a run: which prepared token shards to read, and how to window them."""

from __future__ import annotations

from typing import Any

from pydantic import PositiveInt, field_validator

from trainers._base import StrictModel, checked_size, parse_bytes
from trainers.storage import Location


class DataConfig(StrictModel):
    path: Location  # folder written by `raytrain data prepare` (manifest.json + Parquet shards), or its URI
    # A URI's shards are read piece by piece, each piece checked against the manifest's sha256 as it arrives
    # and kept once per machine in RAYTRAIN_CACHE (default ~/.cache/raytrain); false: kept in memory.
    cache: bool = True
    # Most bytes of a URI's pieces kept: on this machine's disk (cache: true, default 20GiB; least recently
    # used out) or in each process's memory (cache: false, default 256MiB).
    cache_bytes: str | None = None
    seq_len: PositiveInt = 128  # tokens per training window (targets are shifted by one)
    shuffle: bool = True  # a seeded permutation of windows per epoch; order is independent of world size

    @field_validator("cache_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return checked_size(v, "data.cache_bytes")  # a size the reader uses: checked here, before any worker

    @property
    def cache_limit(self) -> int | None:
        """`cache_bytes` in bytes (None: the reader's default)."""
        return None if self.cache_bytes is None else parse_bytes(self.cache_bytes, "data.cache_bytes")
