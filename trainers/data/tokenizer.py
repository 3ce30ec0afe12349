"""Tokenizers: raw bytes (257 ids), a byte-level BPE trained with `tokenizers`, or the tokenizer.json of a
Hugging Face model folder; `load_tokenizer` rebuilds a prepared folder's, `save_hf` writes one AutoTokenizer
loads (to the same ids).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from trainers._base import ConfigError
from trainers.data.manifest import read_manifest
from trainers.storage import location

__all__ = ["EOS_TOKEN", "TOKENIZER_FILE", "BPETokenizer", "ByteTokenizer", "PretrainedTokenizer", "Tokenizer",
           "load_tokenizer", "save_hf"]

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

    def to_hf(self) -> HFTokenizer: ...


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

    def to_hf(self) -> HFTokenizer:
        """A byte-level BPE with no merges whose ids are the bytes themselves, and `<eos>` = 256."""
        byte_chars = _bytes_to_unicode()
        tok = HFTokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
        tok.encode_special_tokens = True
        return tok


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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # Runs on all cores in Rust (one in prepare's worker processes); the fast form skips the offsets.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: Path) -> dict[str, Any]:
        self._tok.save(str(folder / TOKENIZER_FILE))
        return {"kind": self.kind, "vocab_size": self.vocab_size, "eos_id": self.eos_id,
                "file": TOKENIZER_FILE}

    def to_hf(self) -> HFTokenizer:
        return self._tok


class PretrainedTokenizer(BPETokenizer):
    """The tokenizer.json of a Hugging Face model folder, used as it is (its post-processor may add a BOS
    token, as AutoTokenizer does); documents end in the folder's eos token."""

    kind = "hf"

    def __init__(self, tok: HFTokenizer, eos_token: str, split_special_tokens: bool) -> None:
        tok.encode_special_tokens = split_special_tokens  # as AutoTokenizer on that folder does
        self._tok, self.eos_token = tok, eos_token
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ConfigError(f"tokenizer.json has no eos token {eos_token!r}; fix: use the model's own folder")
        self.eos_id, self.vocab_size = eos, tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_folder(cls, folder: Path | Any) -> PretrainedTokenizer:
        """From an HF folder, local or in a bucket: tokenizer.json, with the eos token named by
        tokenizer_config.json (or config.json's eos_token_id)."""
        folder = location(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError(
                f"--tokenizer {folder}: no {TOKENIZER_FILE} there; fix: use the model folder that holds it "
                f"(a fast tokenizer, as save_pretrained or `raytrain export` write it)"
            )
        tok = HFTokenizer.from_str(path.read_text())
        settings = _read_json(folder / "tokenizer_config.json")
        eos = settings.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos is None and isinstance(_read_json(folder / "config.json").get("eos_token_id"), int):
            eos = tok.id_to_token(_read_json(folder / "config.json")["eos_token_id"])
        if eos is None:
            raise ConfigError(
                f"--tokenizer {folder}: no eos token in tokenizer_config.json or config.json; fix: add "
                f'"eos_token" to tokenizer_config.json (documents are separated by it)'
            )
        return cls(tok, eos, bool(settings.get("split_special_tokens", False)))

    def save(self, folder: Path) -> dict[str, Any]:
        return {**super().save(folder), "eos_token": self.eos_token,
                "split_special_tokens": self._tok.encode_special_tokens}


def save_hf(tok: Tokenizer, folder: Path, model_max_length: int) -> None:
    """`tok` as a folder `AutoTokenizer.from_pretrained` loads: tokenizer.json, tokenizer_config.json and
    special_tokens_map.json. Ours keep special-token text as text (split_special_tokens), as in prepare."""
    hf = tok.to_hf()
    hf.save(str(folder / TOKENIZER_FILE))
    eos = hf.id_to_token(tok.eos_id)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "model_max_length": model_max_length,
        "split_special_tokens": hf.encode_special_tokens,
        "clean_up_tokenization_spaces": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos}, indent=2) + "\n")


def _from_file(path: Path | Any) -> HFTokenizer:
    if not path.is_file():
        raise ConfigError(f"{path} not found; fix: prepare the data folder again (raytrain data prepare)")
    return HFTokenizer.from_str(path.read_text())  # a local file or an object in a bucket


def _read_json(path: Path | Any) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"{path} is not JSON ({e}); fix: save the model folder again") from None
    return data if isinstance(data, dict) else {}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of `pre_tokenizers.ByteLevel`."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_tokenizer(data_dir: str | Path | Any) -> Tokenizer:
    """The tokenizer a prepared-data folder (local or in a bucket) was written with (from its manifest)."""
    data_dir = location(data_dir)
    entry = read_manifest(data_dir)["tokenizer"]
    if entry["kind"] == ByteTokenizer.kind:
        return ByteTokenizer()
    if entry["kind"] == BPETokenizer.kind:
        return BPETokenizer(_from_file(data_dir / entry["file"]))
    if entry["kind"] == PretrainedTokenizer.kind:
        tok = _from_file(data_dir / entry["file"])
        return PretrainedTokenizer(tok, entry["eos_token"], entry["split_special_tokens"])
    raise ConfigError(f"data.path={data_dir}: unknown tokenizer kind {entry['kind']!r}; "
                      "fix: prepare it again")
