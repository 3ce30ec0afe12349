"""Data at the sizes users train on: a worker's start on prepared corpora of 10M, 100M and 1B tokens (time to
its first batch, resident memory for data), the tokens/s it delivers against what a training step consumes,
the same from a bucket, and prepare's throughput per core against `tokenizers`' own batch encode.

    python bench/data.py [--sizes 10M,100M,1B] [--repeats 5] [--keep] [--out bench/results/data.json]

Corpora: synthetic documents of byte tokens (lengths 50-4,000) written straight in the prepared format by
`CorpusWriter` (what `raytrain data prepare` writes; the reader cannot tell), under bench/_work/data, deleted at
the end unless --keep (the 1B-token corpus is 4 GB: 4 bytes a token, see docs/data.md).

A worker's start, in a fresh Python process per size and repeat: after its imports, RSS (VmRSS) is taken; then
`TokenWindows` opens the train split, `GlobalSampler` gives the first global batch (32 windows of 2,048 tokens,
shuffled), `get` reads it. Reported: the time from opening to that batch, and RSS after it less RSS before
(shards are read with pread, so the page cache is not in a process's RSS). "warm": the corpus's pages in the
page cache, as after prepare or an earlier run; "cold": evicted first (posix_fadvise DONTNEED). The first
process of a size also writes the epoch's order file (RAYTRAIN_CACHE/order; "first start"), later ones read it.
Then 200 more batches: the tokens/s one process delivers, against the tokens/s a training step consumes in
bench/results/gpu.json (H200) and trainer_overhead.json (this CPU).

A bucket: the 10M corpus uploaded to a moto S3 server on loopback (tests/s3_server.py), read by a fresh process
with an empty cache: its first batch (1 MiB ranged GETs, each piece checked), then 50 batches with the next
batch prefetched, and 50 without.

Prepare: 32 MB of Python source from this venv's site-packages (sorted: the same every run) as JSONL, and a
32,000-token byte-level BPE trained here on a quarter of it, saved as a model folder. `tokenizers`' own
`encode_batch` (all cores: its Rust threads) over the same documents in the same 1 MB batches, against
`prepare_corpus` with that folder as --tokenizer and one process per core (reading JSONL, tokenizing, writing
shards, hashing); per core = throughput / usable cores, for both. Alternated, --repeats rounds, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
from provenance import git_state, provenance  # noqa: E402

WORK = ROOT / "bench" / "_work" / "data"
SEQ_LEN, BATCH = 2048, 32
STEADY_BATCHES = 200
TARGETS = {
    "first_batch_s_at_1B": 2.0,
    "data_rss_bytes_at_1B": 256 << 20,
    "flat_vs_10M": 1.2,  # the 1B figure at most this times the 10M one
    "prepare_vs_tokenizers_per_core": 0.8,
}
SIZES = {"10M": 10_000_000, "100M": 100_000_000, "1B": 1_000_000_000}


# ------------------------------------------------------------------------------------------ corpora


def write_corpus(out: Path, tokens: int, seed: int = 0) -> dict[str, Any]:
    """`tokens` train tokens (and ~0.1% of that, at least 100k, of val) of random byte documents."""
    from trainers.data.prepare import CorpusWriter
    from trainers.data.tokenizer import ByteTokenizer

    tok, rng = ByteTokenizer(), np.random.default_rng(seed)
    started = time.perf_counter()
    with CorpusWriter(out, tok) as writer:
        for split, total in (("train", tokens), ("val", max(100_000, tokens // 1000))):
            written = 0
            while written < total:
                lengths = rng.integers(50, 4000, size=4096)
                lengths = lengths[np.cumsum(lengths) <= total - written]
                if not len(lengths):  # the last, shorter document
                    lengths = np.array([total - written])
                values = rng.integers(0, 256, size=int(lengths.sum()), dtype=np.uint16)
                values[np.cumsum(lengths) - 1] = tok.eos_id
                writer.add(split, values, lengths)
                written += int(lengths.sum())
        manifest = writer.finish(seed=seed, val_fraction=0.001, source={"synthetic": True})
    seconds = time.perf_counter() - started
    size = sum(f.stat().st_size for f in out.iterdir())
    return {"tokens": manifest["splits"]["train"]["tokens"], "bytes_on_disk": size,
            "shards": len(manifest["splits"]["train"]["shards"]), "write_s": seconds}


def evict(folder: Path) -> None:
    """Drop a folder's pages from the page cache (written back first: only clean pages can be dropped; no root
    needed)."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------------ a worker's start


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def child(args: argparse.Namespace) -> None:
    """One worker's start (run in a fresh process): prints one JSON line."""
    import gc

    import torch  # noqa: F401  (a worker has torch loaded: its RSS is not the data's)

    from trainers.data.dataset import GlobalSampler, TokenWindows, shard_for_rank
    from trainers.storage import location

    location(args.data)  # a bucket's file system imported and its client made: their memory is not the data's
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    data = TokenWindows(args.data, "train", SEQ_LEN)
    sampler = GlobalSampler(data.num_windows, seed=0, shuffle=True)
    ids = shard_for_rank(sampler.window_ids(0, BATCH), 0, 1)
    if args.prefetch:
        data.prefetch(sampler.window_ids(BATCH, BATCH))
    inputs, targets = data.get(ids)
    first = time.perf_counter() - t0
    gc.collect()
    after_first = rss_bytes()
    t1 = time.perf_counter()
    for step in range(1, args.batches + 1):
        if args.prefetch:
            data.prefetch(sampler.window_ids((step + 1) * BATCH, BATCH))
        data.get(sampler.window_ids(step * BATCH, BATCH))
    steady = time.perf_counter() - t1
    gc.collect()
    print(json.dumps({
        "first_batch_s": first,
        "data_rss_bytes": after_first - before,
        "data_rss_after_batches_bytes": rss_bytes() - before,
        "tokens_per_s": args.batches * BATCH * SEQ_LEN / steady if args.batches else None,
        "num_windows": data.num_windows,
    }))


def start(data: str, batches: int, env: dict[str, str] | None = None, prefetch: bool = False) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--data", data, "--batches", str(batches)]
    out = subprocess.run(command + (["--prefetch"] if prefetch else []), capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=900, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def starts(folder: Path, repeats: int, cache: Path) -> dict[str, Any]:
    env = {"RAYTRAIN_CACHE": str(cache)}
    shutil.rmtree(cache, ignore_errors=True)
    evict(folder)
    first = start(str(folder), 0, env)  # the machine's first start: writes the epoch's order file
    warm, cold = [], []
    for _ in range(repeats):
        cold.append(start_cold(folder, env))
        warm.append(start(str(folder), 0, env))
    steady = start(str(folder), STEADY_BATCHES, env)
    return {
        "first_start": first,
        "warm": _medians(warm),
        "cold": _medians(cold),
        "warm_runs": warm,
        "cold_runs": cold,
        "delivered_tokens_per_s": steady["tokens_per_s"],
        "data_rss_after_batches_bytes": steady["data_rss_after_batches_bytes"],
    }


def start_cold(folder: Path, env: dict[str, str]) -> dict[str, Any]:
    evict(folder)
    return start(str(folder), 0, env)


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in ("first_batch_s", "data_rss_bytes")}


def bucket(folder: Path, work: Path) -> dict[str, Any]:
    from tests.s3_server import s3_server
    from trainers.storage import location, upload_folder

    with s3_server() as server:
        uri = f"s3://{server.make_bucket('bench')}/corpus"
        t0 = time.perf_counter()
        upload_folder(folder, location(uri))
        upload_s = time.perf_counter() - t0
        env = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
        runs = {}
        for name, prefetch in (("prefetch", True), ("no_prefetch", False)):
            cache = work / f"cache-bucket-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            runs[name] = start(uri, 50, {**env, "RAYTRAIN_CACHE": str(cache)}, prefetch=prefetch)
            shutil.rmtree(cache, ignore_errors=True)
    return {"uri": "s3://<moto on 127.0.0.1>/corpus", "upload_s": upload_s, **runs}


# ------------------------------------------------------------------------------------------ prepare


def sample_text(out: Path, max_bytes: int) -> tuple[Path, list[str]]:
    """Python source from site-packages, one JSONL record a file, up to `max_bytes` of text."""
    site = Path(np.__file__).resolve().parents[1]
    texts, total = [], 0
    for f in sorted(site.rglob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(text)
            total += len(text.encode())
        if total >= max_bytes:
            break
    with open(out, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return out, texts


def prepare_throughput(work: Path, repeats: int, sample_bytes: int) -> dict[str, Any]:
    from tokenizers import Tokenizer

    from trainers.data.prepare import _BATCH_BYTES, _cores, prepare_corpus
    from trainers.data.tokenizer import BPETokenizer, save_hf

    jsonl, texts = sample_text(work / "sample.jsonl", sample_bytes)
    text_bytes = sum(len(t.encode()) for t in texts)
    model = work / "bpe-32k"
    model.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    save_hf(BPETokenizer.train(texts[: len(texts) // 4], vocab_size=32_000), model, model_max_length=2048)
    train_s = time.perf_counter() - t0
    hf = Tokenizer.from_file(str(model / "tokenizer.json"))
    hf.encode_special_tokens = True  # as prepare encodes
    batches, batch, size = [], [], 0
    for text in texts:  # prepare's batches: 1 MB of text each
        batch.append(text)
        size += len(text)
        if size >= _BATCH_BYTES:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    cores = _cores()
    rounds: list[dict[str, float]] = []
    for _ in range(repeats):
        row = {}
        for name in ("encode_batch", "encode_batch_fast"):
            t0 = time.perf_counter()
            tokens = sum(len(e.ids) for b in batches for e in getattr(hf, name)(b))
            row[name] = time.perf_counter() - t0
        out = work / "prepared"
        t0 = time.perf_counter()
        manifest = prepare_corpus([jsonl], out, tokenizer=str(model), workers=cores, progress=False,
                                  say=lambda line: None)
        row["prepare"] = time.perf_counter() - t0
        row["prepare_tokens"] = manifest["splits"]["train"]["tokens"] + manifest["splits"]["val"]["tokens"]
        row["encode_tokens"] = tokens
        rounds.append(row)
        shutil.rmtree(out, ignore_errors=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in ("encode_batch", "encode_batch_fast", "prepare")}
    per_core = {k: text_bytes / med[k] / cores for k in med}
    return {
        "sample_bytes": text_bytes,
        "documents": len(texts),
        "tokens": rounds[0]["encode_tokens"],
        "bpe_vocab": 32_000,
        "bpe_train_s": train_s,
        "cores": cores,
        "rounds": rounds,
        "median_s": med,
        "bytes_per_s_per_core": per_core,
        "prepare_vs_encode_batch": per_core["prepare"] / per_core["encode_batch"],
        "prepare_vs_encode_batch_fast": per_core["prepare"] / per_core["encode_batch_fast"],
    }


# ------------------------------------------------------------------------------------ what a step eats


def consumed() -> dict[str, Any]:
    """Tokens/s a training step consumes, from the project's own measurements."""
    out: dict[str, Any] = {}
    gpu = ROOT / "bench" / "results" / "gpu.json"
    if gpu.is_file():
        g = json.loads(gpu.read_text())
        rows = {r["name"]: r["tokens_per_s"] for r in g["rows"] if r.get("tokens_per_s")}
        big = max((v, k) for k, v in rows.items() if k.startswith("big/"))
        seed = max((v, k) for k, v in rows.items() if k.startswith("seed/"))
        out["gpu_1.1b"] = {"tokens_per_s": big[0], "row": big[1], "device": g.get("device_name"), "date": g.get("date")}
        out["gpu_tiny"] = {"tokens_per_s": seed[0], "row": seed[1], "device": g.get("device_name"), "date": g.get("date")}
    cpu = ROOT / "bench" / "results" / "trainer_overhead.json"
    if cpu.is_file():
        c = json.loads(cpu.read_text())
        train, data = c["reference_config"]["train"], c["reference_config"]["data"]
        tokens = train["global_batch_size"] * data["seq_len"]
        out["cpu_reference"] = {"tokens_per_s": tokens / c["overhead"]["trainer"]["median_step_s"],
                                "row": "trainer_overhead.json reference", "date": c.get("date")}
    return out


# ------------------------------------------------------------------------------------------ checks


def checks(result: dict[str, Any]) -> dict[str, Any]:
    sizes = result["sizes"]
    small, large = sizes.get("10M"), sizes.get("1B")
    out: dict[str, Any] = {}
    if small and large:
        for kind in ("warm", "cold"):
            t_small, t_large = small[kind]["first_batch_s"], large[kind]["first_batch_s"]
            m_small, m_large = small[kind]["data_rss_bytes"], large[kind]["data_rss_bytes"]
            out[f"first_batch_{kind}"] = {
                "at_1B_s": t_large, "at_10M_s": t_small, "ratio": t_large / t_small,
                "met": t_large <= TARGETS["first_batch_s_at_1B"] and t_large <= TARGETS["flat_vs_10M"] * t_small,
            }
            out[f"data_rss_{kind}"] = {
                "at_1B_bytes": m_large, "at_10M_bytes": m_small, "ratio": m_large / max(m_small, 1),
                "met": m_large <= TARGETS["data_rss_bytes_at_1B"] and m_large <= TARGETS["flat_vs_10M"] * m_small,
            }
    prep = result.get("prepare")
    if prep:
        out["prepare"] = {"ratio": prep["prepare_vs_encode_batch"],
                          "met": prep["prepare_vs_encode_batch"] >= TARGETS["prepare_vs_tokenizers_per_core"]}
    return out


# ------------------------------------------------------------------------------------------ plot


def plot(result: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 9))
    FigureCanvasAgg(fig)
    (a, b), (c, d) = fig.subplots(2, 2)
    names = list(result["sizes"])
    tokens = [result["sizes"][n]["corpus"]["tokens"] for n in names]
    for kind, style in (("warm", "o-"), ("cold", "s--")):
        a.plot(tokens, [result["sizes"][n][kind]["first_batch_s"] * 1e3 for n in names], style, label=kind)
        b.plot(tokens, [result["sizes"][n][kind]["data_rss_bytes"] / 2**20 for n in names], style, label=kind)
    a.plot(tokens, [result["sizes"][n]["first_start"]["first_batch_s"] * 1e3 for n in names], "^:",
           label="first start on the machine (writes the epoch's order)")
    for ax, title, unit in ((a, "time to a worker's first batch (32 x 2,048 tokens; target at 1B: 2 s)", "ms"),
                            (b, "resident memory for data after it (RSS delta; target at 1B: 256 MiB)", "MiB")):
        ax.set_xscale("log")
        ax.set_xlabel("corpus, train tokens")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    prep = result.get("prepare")
    if prep:
        labels = ["tokenizers\nencode_batch", "tokenizers\nencode_batch_fast", "raytrain data\nprepare"]
        values = [prep["bytes_per_s_per_core"][k] / 1e6 for k in ("encode_batch", "encode_batch_fast", "prepare")]
        c.bar(labels, values, color=["#7f7f7f", "#bcbd22", "#1f77b4"])
        c.set_ylabel("MB of text / s / core")
        c.set_title(f"tokenizing {prep['sample_bytes'] / 1e6:.0f} MB, 32k BPE, {prep['cores']} cores: "
                    f"prepare = {prep['prepare_vs_encode_batch']:.2f}x encode_batch", fontsize=10)
    bars = {f"delivered, 1 process\n{n} local": result["sizes"][n]["delivered_tokens_per_s"] for n in names}
    if result.get("bucket"):
        bars["delivered, bucket 10M\nprefetch"] = result["bucket"]["prefetch"]["tokens_per_s"]
    for key, row in result.get("consumed", {}).items():
        bars[f"consumed: {key}\n({row.get('device') or 'this CPU'})"] = row["tokens_per_s"]
    d.barh(list(bars), list(bars.values()), color=["#1f77b4"] * (len(bars) - len(result.get("consumed", {})))
           + ["#ff7f0e"] * len(result.get("consumed", {})))
    d.set_xscale("log")
    d.set_xlabel("tokens / s")
    d.tick_params(axis="y", labelsize=7)
    d.set_title("tokens/s a worker's reader delivers vs a training step consumes", fontsize=10)
    env = result["environment"]
    fig.suptitle(f"bench/data.py at {str(env['git_commit'])[:8]}, {env['cpus']} cores, load "
                 f"{env['loadavg_before'][0]:.1f} before / {env['loadavg_after'][0]:.1f} after, {env['date'][:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10M,100M,1B")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prepare-repeats", type=int, default=3)
    parser.add_argument("--sample-bytes", type=int, default=32_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the corpora under bench/_work/data")
    parser.add_argument("--no-bucket", action="store_true")
    parser.add_argument("--no-prepare", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prefetch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    started, load_before = time.time(), os.getloadavg()
    WORK.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"targets": TARGETS, "seq_len": SEQ_LEN, "batch": BATCH, "sizes": {}}
    try:
        for name in [n for n in args.sizes.split(",") if n]:
            folder = WORK / f"corpus-{name}"
            need = SIZES[name] * 4.2
            if shutil.disk_usage(WORK).free < need * 1.5:
                raise SystemExit(f"not enough disk for the {name} corpus ({need / 1e9:.1f} GB)")
            print(f"writing the {name}-token corpus ...", flush=True)
            corpus = write_corpus(folder, SIZES[name])
            print(f"  {corpus}; measuring starts ...", flush=True)
            result["sizes"][name] = {"corpus": corpus, **starts(folder, args.repeats, WORK / f"cache-{name}")}
            print(f"  warm {result['sizes'][name]['warm']}, cold {result['sizes'][name]['cold']}", flush=True)
            if name == "10M" and not args.no_bucket:
                print("the 10M corpus in a bucket ...", flush=True)
                result["bucket"] = bucket(folder, WORK)
            if not args.keep and name != "10M":
                shutil.rmtree(folder)
        if not args.no_prepare:
            print("prepare vs tokenizers ...", flush=True)
            result["prepare"] = prepare_throughput(WORK, args.prepare_repeats, args.sample_bytes)
    finally:
        if not args.keep:
            shutil.rmtree(WORK, ignore_errors=True)
    result["consumed"] = consumed()
    result["checks"] = checks(result)
    result["environment"] = {**provenance(started, load_before), **git_state()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result["checks"], indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
