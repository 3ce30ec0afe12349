"""Documents to token ids, in prepare's process or in its worker processes.

A worker imports only this module, numpy and `tokenizers` (a spawned process starts in a fraction of a second):
it gets the tokenizer as its JSON and rebuilds it, with one thread, since the pool is the parallelism.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["encode_documents", "stored_dtype", "worker_spec"]


class _Encodes(Protocol):
    vocab_size: int
    eos_id: int

    def encode_batch(self, texts: Sequence[str]) -> list[Any]: ...


def stored_dtype(vocab_size: int) -> type[np.unsignedinteger]:
    return np.uint16 if vocab_size < 1 << 16 else np.uint32


def encode_documents(tok: _Encodes, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token values, document lengths) of `texts`, each document followed by eos, in the stored dtype."""
    ids = tok.encode_batch(texts)
    lengths = np.fromiter((len(a) + 1 for a in ids), dtype=np.int64, count=len(ids))
    values = np.empty(int(lengths.sum()), dtype=stored_dtype(tok.vocab_size))
    ends = np.cumsum(lengths)
    for a, end in zip(ids, ends.tolist()):
        values[end - 1 - len(a) : end - 1] = a
    values[ends - 1] = tok.eos_id
    return values, lengths


def worker_spec(hf: Any, eos_id: int, vocab_size: int) -> tuple[str, bool, int, int]:
    """What a worker needs of a `tokenizers.Tokenizer`: its JSON, whether special tokens' text stays text
    (not in the JSON), eos and vocabulary size."""
    return hf.to_str(), hf.encode_special_tokens, eos_id, vocab_size


class _Worker:
    def __init__(self, spec: tuple[str, bool, int, int]) -> None:
        from tokenizers import Tokenizer

        text, special, self.eos_id, self.vocab_size = spec
        self.tok = Tokenizer.from_str(text)
        self.tok.encode_special_tokens = special

    def encode_batch(self, texts: Sequence[str]) -> list[Any]:
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # the same ids, no offsets
        return [e.ids for e in encode(list(texts))]


_worker: _Worker | None = None


def start_worker(spec: tuple[str, bool, int, int]) -> None:
    # One core per process: tokenizers would otherwise start a thread per core in every process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    global _worker
    _worker = _Worker(spec)


def encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker is not None, "start_worker first"
    return encode_documents(_worker, texts)
