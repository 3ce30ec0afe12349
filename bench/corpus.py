"""A bench's corpus: the prepared one it is given, or byte tokens of this Python's standard library, made once
under the bench's work folder (no download and no `raytrain` command: what a bare GPU machine can run)."""

from __future__ import annotations

from pathlib import Path

from trainers.data.prepare import default_corpus, prepare_corpus


def prepared(data: str | Path | None, made: Path, max_bytes: int, val_fraction: float = 0.05) -> Path:
    """`data`, or the corpus at `made`, prepared from the standard library first if it is not there yet."""
    if data is not None:
        return Path(data)
    if not (made / "manifest.json").is_file():
        print(f"preparing a corpus of the standard library at {made} ...", flush=True)
        prepare_corpus(default_corpus(), made, max_bytes=max_bytes, val_fraction=val_fraction, progress=False)
    return made
