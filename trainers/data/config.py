"""Data section of a run: which prepared token shards to read, and how to window them."""

from __future__ import annotations

from pydantic import PositiveInt

from trainers._base import StrictModel
from trainers.storage import Location


class DataConfig(StrictModel):
    path: Location  # folder written by `raytrain data prepare` (manifest.json + Parquet shards), or its URI
    # A URI's shards are copied once per machine into RAYTRAIN_CACHE (default ~/.cache/raytrain), checked
    # against the manifest's sha256; false: read into memory from the store at every start (checked too).
    cache: bool = True
    seq_len: PositiveInt = 128  # tokens per training window (targets are shifted by one)
    shuffle: bool = True  # a seeded permutation of windows per epoch; order is independent of world size
