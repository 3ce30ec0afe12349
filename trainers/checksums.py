"""Checksums of checkpoint files in fixed pieces, hashed in parallel: no single-threaded second pass.

A checkpoint's `COMMITTED` marker names the hash and piece size and holds, per file, its size and one
digest per piece. Pieces are hashed as the file is written (`StreamDigests`) or read back spread over the
ranks and a thread pool (`digest_pieces`): xxh3-128 hashes ~16 GB/s a core and releases the GIL, so on a
file still in the page cache the pass costs a small fraction of the write. Markers written before pieces
existed hold one whole-file `sha256` per file; they still verify.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from trainers.storage import read_range, sha256_of

__all__ = ["HASH", "PIECE_BYTES", "Piece", "StreamDigests", "check_files", "digest_pieces", "pieces_of"]

HASH = "xxh3_128"
PIECE_BYTES = 64 << 20  # what one thread hashes at a time: large enough to stream, small enough to spread

Piece = tuple[str, int, int, int]  # (file name, piece index, offset, length)


def pieces_of(sizes: dict[str, int], piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Every file's pieces, in a fixed order (the same on every rank)."""
    out: list[Piece] = []
    for name in sorted(sizes):
        count = max(1, -(-sizes[name] // piece_bytes))
        out += [(name, i, i * piece_bytes, min(piece_bytes, sizes[name] - i * piece_bytes)) for i in range(count)]
    return out


def _digest(root: Any, piece: Piece) -> str:
    name, _, offset, length = piece
    return xxhash.xxh3_128_hexdigest(read_range(root / name, offset, length))


class StreamDigests:
    """The piece digests of a file fed to `update` in order as it is written: what `digest_pieces` finds
    reading it back (one digest per started piece; an empty file has one, of no bytes). `seconds`: the time
    spent hashing."""

    def __init__(self, piece_bytes: int = PIECE_BYTES):
        self.piece_bytes, self.size, self.seconds, self._done = piece_bytes, 0, 0.0, []
        self._piece, self._filled = xxhash.xxh3_128(), 0

    def update(self, data: Any) -> None:
        start, view = time.perf_counter(), memoryview(data).cast("B")
        while len(view):
            if self._filled == self.piece_bytes:
                self._done.append(self._piece.hexdigest())
                self._piece, self._filled = xxhash.xxh3_128(), 0
            take = min(len(view), self.piece_bytes - self._filled)
            self._piece.update(view[:take])
            self._filled, self.size, view = self._filled + take, self.size + take, view[take:]
        self.seconds += time.perf_counter() - start

    def digests(self) -> list[str]:
        return [*self._done, self._piece.hexdigest()]


def digest_pieces(root: Any, pieces: Iterable[Piece], threads: int) -> dict[tuple[str, int], str]:
    """{(file, piece index): digest} for `pieces` of the files under `root`, `threads` at a time."""
    pieces = list(pieces)
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="checksum") as pool:
        digests = list(pool.map(lambda p: _digest(root, p), pieces))
    return {(p[0], p[1]): d for p, d in zip(pieces, digests)}


def check_files(
    root: Any, marker: dict[str, Any], sizes: dict[str, int | None], rank: int, world: int, threads: int
) -> str | None:
    """Why the files under `root` do not match `marker` (this rank's share of the work), or None.
    `sizes`: each file's size on disk (None: missing)."""
    expected: dict[str, dict[str, Any]] = marker["files"]
    for name in sorted(expected):
        if sizes.get(name) is None:
            return f"{name} is missing"
        if sizes[name] != expected[name]["size"]:
            return f"{name} has {sizes[name]} bytes, {expected[name]['size']} were written"
    if marker.get("hash") is None:  # a marker from before pieces: one sha256 per file, files spread on ranks
        names = sorted(expected)[rank::world]
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="checksum") as pool:
            found = list(pool.map(lambda n: sha256_of(root / n), names))
        bad = [n for n, d in zip(names, found) if d != expected[n]["sha256"]]
        return f"{bad[0]} does not match its sha256" if bad else None
    if marker["hash"] != HASH:
        return f"{marker['hash']} checksums cannot be checked by this version (it knows {HASH})"
    mine = pieces_of({n: e["size"] for n, e in expected.items()}, marker["piece_bytes"])[rank::world]
    found = digest_pieces(root, mine, threads)
    bad = sorted({name for (name, i), d in found.items() if d != expected[name]["pieces"][i]})
    return f"{bad[0]} does not match its {HASH} checksum" if bad else None
