"""bench/moe.py's results file: one moe.json holds the latest CPU and GPU runs (the issue's contract: its
`rows` name tiny-moe, wide-moe and gpu-moe); a bench given no corpus makes one (a bare GPU machine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import corpus  # noqa: E402
import moe  # noqa: E402

from trainers.data.manifest import read_manifest  # noqa: E402


def _run(device: str, names: list[str], tag: str) -> dict:
    rows = [{"name": n, "device": device, "path": p, "mfu": 0.1, "tag": tag} for n in names for p in moe.IMPLS]
    return {"device": device, "models": {n: {"tag": tag} for n in names}, "rows": rows}


def test_a_run_on_one_device_keeps_the_others_latest_run(tmp_path):
    path = tmp_path / "moe.json"

    def write(device, names, tag):
        path.write_text(json.dumps(moe.merged(path, _run(device, names, tag), device)))
        return json.loads(path.read_text())

    first = write("cpu", ["tiny-moe", "wide-moe"], "cpu-1")
    assert first["device"] == "cpu" and "gpu" not in first and len(first["rows"]) == 4
    second = write("cuda", ["gpu-moe"], "gpu-1")
    assert second["models"] == first["models"] and second["gpu"]["models"] == {"gpu-moe": {"tag": "gpu-1"}}
    assert sorted({(r["name"], r["tag"]) for r in second["rows"]}) == [
        ("gpu-moe", "gpu-1"), ("tiny-moe", "cpu-1"), ("wide-moe", "cpu-1")]
    third = write("cpu", ["tiny-moe", "wide-moe"], "cpu-2")
    assert third["gpu"] == second["gpu"]
    assert sorted({(r["name"], r["tag"]) for r in third["rows"]}) == [
        ("gpu-moe", "gpu-1"), ("tiny-moe", "cpu-2"), ("wide-moe", "cpu-2")]
    fourth = write("cuda", ["gpu-moe"], "gpu-2")  # the GPU's rows replaced, not added
    assert sorted({(r["name"], r["tag"]) for r in fourth["rows"]}) == [
        ("gpu-moe", "gpu-2"), ("tiny-moe", "cpu-2"), ("wide-moe", "cpu-2")]
    assert len(fourth["rows"]) == 6


def test_without_a_corpus_one_is_made_once_from_the_standard_library(tmp_path):
    made = corpus.prepared(None, tmp_path / "corpus", max_bytes=2_000_000)
    manifest = read_manifest(made)
    assert made == tmp_path / "corpus" and manifest["splits"]["train"]["shards"]
    stamp = (made / "manifest.json").stat().st_mtime_ns
    assert corpus.prepared(None, made, max_bytes=2_000_000) == made
    assert (made / "manifest.json").stat().st_mtime_ns == stamp  # not made again
    assert corpus.prepared("given/corpus", made, max_bytes=1) == Path("given/corpus")
