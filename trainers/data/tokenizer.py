"""Tokenizers: raw bytes (no training, 257 ids) or a byte-level BPE trained locally with `tokenizers`.

Both share one small interface (`encode`, `encode_batch`, `decode`, `vocab_size`, `eos_id`, `save`);
`load_tokenizer(data_dir)` rebuilds the one a prepared-data folder was written with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from trainers._base import ConfigError
from trainers.data.manifest import read_manifest

__all__ = ["EOS_TOKEN", "TOKENIZER_FILE", "BPETokenizer", "ByteTokenizer", "Tokenizer", "load_tokenizer"]

EOS_TOKEN = "<eos>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def save(self, folder: Path) -> dict[str, Any]: ...


class ByteTokenizer:
    """ids 0-255 are the UTF-8 bytes of the text; 256 marks the end of a document."""

    kind = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # A model may emit a byte sequence that is not valid UTF-8; show it rather than fail.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, folder: Path) -> dict[str, Any]:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


class BPETokenizer:
    """Byte-level BPE (GPT-2 style): any text round-trips; `<eos>` is the only special token."""

    kind = "bpe"

    def __init__(self, tok: HFTokenizer) -> None:
        # Text that happens to contain "<eos>" must stay text, not become a document boundary.
        tok.encode_special_tokens = True
        self._tok = tok
        eos = tok.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ConfigError(f"tokenizer has no {EOS_TOKEN} token; fix: prepare the data again")
        self.eos_id: int = eos
        self.vocab_size: int = tok.get_vocab_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Learn merges from `texts`; a small corpus may stop short of `vocab_size` (the real size is kept)."""
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path: Path) -> BPETokenizer:
        if not path.is_file():
            raise ConfigError(f"{path} not found; fix: prepare the data folder again (raytrain data prepare)")
        return cls(HFTokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # encode_batch runs on all cores in Rust; prepare calls it on chunks of documents.
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: Path) -> dict[str, Any]:
        self._tok.save(str(folder / TOKENIZER_FILE))
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "file": TOKENIZER_FILE,
        }


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared-data folder was written with (from its manifest)."""
    data_dir = Path(data_dir)
    entry = read_manifest(data_dir)["tokenizer"]
    if entry["kind"] == ByteTokenizer.kind:
        return ByteTokenizer()
    if entry["kind"] == BPETokenizer.kind:
        return BPETokenizer.from_file(data_dir / entry["file"])
    raise ConfigError(
        f"data.path={data_dir}: unknown tokenizer kind {entry['kind']!r}; fix: prepare it again"
    )
