"""Data section of a run: which prepared token shards to read, and how to window them."""

from __future__ import annotations

from pathlib import Path

from pydantic import PositiveInt

from trainers._base import StrictModel


class DataConfig(StrictModel):
    path: Path  # folder written by `raytrain data prepare` (manifest.json + Parquet shards)
    seq_len: PositiveInt = 128  # tokens per training window (targets are shifted by one)
    shuffle: bool = True  # a seeded permutation of windows per epoch; order is independent of world size
