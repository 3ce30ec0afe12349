"""Reading prepared token shards as fixed windows, and the global, resumable sample order.

The data position of a run is a count of GLOBAL samples consumed. The global batch of step t is
always samples [t*B, (t+1)*B) of `GlobalSampler`; data-parallel rank r takes the r-th contiguous
slice of it (`shard_for_rank`) and splits that into micro-batches in order. So any number of ranks
sees the same samples per step, and a run resumed at another world size continues the same order.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import numpy as np
import torch
import xxhash

from trainers._base import ConfigError
from trainers.data.manifest import read_manifest
from trainers.data.shards import SplitStream
from trainers.storage import cache_root, location

__all__ = ["GlobalSampler", "TokenWindows", "eval_window_ids", "shard_for_rank"]


class TokenWindows:
    """One split as a contiguous token stream cut into windows of `seq_len` (+1 for the shifted targets).

    Window i covers stream[i*seq_len : i*seq_len + seq_len + 1]: consecutive windows share one token, so that
    every token is a target exactly once. The first window is read here, so that a folder that cannot be read
    fails before any step.
    """

    def __init__(
        self, data_dir: str | Path, split: str, seq_len: int, cache: bool = True, cache_bytes: int | None = None
    ) -> None:
        self.data_dir = location(data_dir)  # a local folder or a URI
        self.cache = cache
        self.split = split
        self.seq_len = seq_len
        self.manifest = read_manifest(self.data_dir)
        self.dtype = np.dtype(self.manifest.get("dtype", "uint16"))
        self.stream = SplitStream(self.data_dir, self.manifest, split, cache, cache_bytes)
        self.num_windows = (self.stream.total - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"data.path={self.data_dir}: the {split} split holds {self.stream.total} tokens, fewer than "
                f"data.seq_len+1={seq_len + 1}; fix: add text or lower data.seq_len"
            )
        self.stream.read(0, seq_len + 1)

    @property
    def tokens(self) -> np.ndarray:
        """The whole split as one array (reads all of it: for tests and tools, not for training)."""
        return self.stream.read(0, self.stream.total).astype(self.dtype)

    def get(self, window_ids: np.ndarray | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both LongTensor[B, seq_len]; targets are inputs shifted left by one token."""
        ids = self._check(window_ids)
        block = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, i in zip(block, ids.tolist()):
            row[:] = self.stream.read(i * self.seq_len, self.seq_len + 1)
        block = torch.from_numpy(block)
        return block[:, :-1].contiguous(), block[:, 1:].contiguous()

    def prefetch(self, window_ids: np.ndarray | list[int]) -> None:
        """Start reading the windows a later `get` will ask for (a bucket's pieces, on threads); returns at once."""
        ids = self._check(window_ids)
        self.stream.prefetch((i * self.seq_len for i in ids.tolist()), self.seq_len + 1)

    def _check(self, window_ids: np.ndarray | list[int]) -> np.ndarray:
        ids = np.asarray(window_ids, dtype=np.int64)
        if ids.ndim != 1 or (len(ids) and (ids.min() < 0 or ids.max() >= self.num_windows)):
            raise IndexError(f"window ids must be a 1-d array in [0, {self.num_windows}), got {window_ids!r}")
        return ids


class GlobalSampler:
    """Window ids of global samples: sample g is position g % N of epoch g // N's permutation.

    Pure in (num_windows, seed, shuffle), so resuming at any sample count continues the same order. A
    permutation of more than `IN_MEMORY` windows is read from a file (`EpochOrder`), so that a worker's
    memory does not grow with the corpus.
    """

    IN_MEMORY = 1 << 17  # windows (1 MiB of order): smaller permutations stay in memory

    def __init__(self, num_windows: int, seed: int, shuffle: bool) -> None:
        self.num_windows = num_windows
        # numpy seeds must be non-negative; a negative config seed maps to its 64-bit two's complement.
        self.seed = seed % (1 << 64)
        self.shuffle = shuffle
        self._perms: dict[int, np.ndarray | EpochOrder] = {}  # cache: the epoch(s) a batch touches

    def window_ids(self, start: int, count: int) -> np.ndarray:
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")
        epochs, positions = np.divmod(np.arange(start, start + count, dtype=np.int64), self.num_windows)
        if not self.shuffle:
            return positions
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))[positions[mask]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray | EpochOrder:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most the current and the next epoch
                self._perms.pop(min(self._perms))
            self._perms[epoch] = self._make(epoch)
        return self._perms[epoch]

    def _make(self, epoch: int) -> np.ndarray | EpochOrder:
        if self.num_windows > self.IN_MEMORY:
            with contextlib.suppress(OSError):  # no cache folder to write: in memory after all
                return EpochOrder.open(self.num_windows, self.seed, epoch)
        return epoch_permutation(self.num_windows, self.seed, epoch)


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_windows)


class EpochOrder:
    """One epoch's permutation in this machine's cache (`cache_root()/order`), written by the first process
    that needs it (whole, then renamed into place) with an xxh3-128 of it at the end, checked when a process
    opens it; indexed by a contiguous run of positions (what a batch asks for), it reads just that run."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    @classmethod
    def open(cls, num_windows: int, seed: int, epoch: int) -> EpochOrder:
        folder = cache_root() / "order"
        path = folder / f"{num_windows}-{seed}-{epoch}-numpy{np.__version__}.i8"
        if not (path.is_file() and cls._intact(path, num_windows)):
            perm = epoch_permutation(num_windows, seed, epoch).astype("<i8")
            folder.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:6]}")
            try:
                with open(tmp, "wb") as f:
                    f.write(perm.data)
                    f.write(xxhash.xxh3_128_digest(perm.data))
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        return cls(path)

    @staticmethod
    def _intact(path: Path, num_windows: int) -> bool:
        size = 8 * num_windows
        if path.stat().st_size != size + 16:
            return False
        digest = xxhash.xxh3_128()
        with open(path, "rb") as f:
            for _ in range(0, size, 1 << 20):
                digest.update(f.read(min(1 << 20, size - f.tell())))
            return digest.digest() == f.read(16)

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        first, last = int(positions.min()), int(positions.max())
        run = np.frombuffer(os.pread(self.fd, 8 * (last - first + 1), 8 * first), "<i8")
        return run[positions - first]

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self.fd)


def shard_for_rank(ids: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Rank `rank` of `world` data-parallel ranks takes the rank-th contiguous slice of a global batch."""
    if len(ids) % world:
        raise ConfigError(
            f"a global batch of {len(ids)} samples does not split over {world} data-parallel ranks; "
            f"fix: make train.global_batch_size a multiple of {world}"
        )
    per_rank = len(ids) // world
    return ids[rank * per_rank : (rank + 1) * per_rank]


def eval_window_ids(num_windows: int, count: int) -> np.ndarray:
    """The first `count` windows in order (at most all of them): the same set at every evaluation."""
    return np.arange(min(count, num_windows), dtype=np.int64)
