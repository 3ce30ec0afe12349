"""Checkpoint save and load time: a bucket on a local S3 server vs local disk, the reference model, one run.

    python bench/storage.py [--repeats 5] [--out bench/results/storage.json]

The design's reference model (Llama form, 4 blocks, dim 256, 4 heads, byte vocabulary: 3.35 M parameters)
with AdamW state (one optimizer step taken), saved and loaded by our `Checkpointer` exactly as a run does
(DCP files, per-file sha256 into COMMITTED, the marker; a load = the checksum verification a restore does +
DCP's read + the RNG state), in one process, alternately to a local temporary folder and to a bucket of a
moto S3 server this script starts on 127.0.0.1 (credentials from the environment it sets; the server is
stopped by its handle at the end). Medians over `--repeats` rounds; each round saves a new step, so
retention deletes the old one as in a run. Writes JSON (command, commit, load average before and after) and a
bar chart beside it.

Each round also pins the saved checkpoint as a PBT trial does (`link_tree`: hard links on disk, copies made
by the store in a bucket): `pin_s` (an exploit then loads the pin in place, as `load_s` measures a load).

What it measures is the protocol's cost against an S3 API on loopback: the HTTP round trips (listings,
HEADs, PUTs of each object, the checksum read-back) with no network bandwidth or latency of a real region.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from run import environment  # noqa: E402  (bench/run.py's: command, commit, load average, versions)

from tests.s3_server import s3_server  # noqa: E402
from trainers.checkpoint import Checkpointer, ModelOptimizerState  # noqa: E402
from trainers.checkpoint_files import link_tree  # noqa: E402
from trainers.models import build_model  # noqa: E402
from trainers.sections.model import ModelConfig  # noqa: E402
from trainers.storage import location, remove_tree  # noqa: E402


def reference_state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=257, dim=256, n_layers=4, n_heads=4, max_seq_len=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 257, (2, 64))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    opt.step()
    return model, opt


def one_round(ckpt: Checkpointer, step: int, model, opt, trial: Any) -> dict[str, float]:
    """`trial`: the folder of a PBT trial beside the run (its pins)."""
    state = {"app": ModelOptimizerState(model, opt)}
    t0 = time.perf_counter()
    path = ckpt.save(step, state, {"step": step}, rng={"torch": torch.get_rng_state()})
    t1 = time.perf_counter()
    problem = Checkpointer.verify(path)
    t2 = time.perf_counter()
    fresh = {"app": ModelOptimizerState(*reference_state())}
    t3 = time.perf_counter()
    ckpt.load(path, fresh)
    t4 = time.perf_counter()
    assert problem is None, problem
    loaded = fresh["app"].model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items()), "loaded != saved"
    pin = trial / "pins" / f"pin-{step}"
    t5 = time.perf_counter()
    link_tree(path, pin / path.name)
    t6 = time.perf_counter()
    assert Checkpointer.verify(pin / path.name) is None
    remove_tree(pin)
    return {
        "save_s": t1 - t0,
        "verify_s": t2 - t1,
        "read_s": t4 - t3,
        "load_s": (t2 - t1) + (t4 - t3),
        "pin_s": t6 - t5,
    }


def checkpoint_bytes(ckpt: Checkpointer) -> int:
    latest = ckpt.latest()
    files = json.loads((latest / "COMMITTED").read_text())["files"]
    return sum(f["size"] for f in files.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "storage.json"))
    args = parser.parse_args()
    result: dict[str, Any] = {"environment": environment(args)}
    model, opt = reference_state()
    params = sum(p.numel() for p in model.parameters())
    rounds: dict[str, list[dict[str, float]]] = {"local": [], "s3": []}
    with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp, s3_server() as server:
        os.environ["RAYTRAIN_CACHE"] = str(Path(tmp) / "cache")
        bucket = server.make_bucket("bench")
        places = {
            "local": Checkpointer(Path(tmp) / "checkpoints", keep=1),
            "s3": Checkpointer(location(f"s3://{bucket}/run/checkpoints"), keep=1),
        }
        trials = {"local": Path(tmp) / "trial", "s3": location(f"s3://{bucket}/trial")}
        for name, ckpt in places.items():  # a warm-up round each (imports, the S3 client's first connection)
            one_round(ckpt, 1, model, opt, trials[name])
        for r in range(args.repeats):
            for name, ckpt in places.items():  # alternating: the machine's load touches both alike
                rounds[name].append(one_round(ckpt, r + 2, model, opt, trials[name]))
        # The same tensors; .metadata and the RNG file differ by a few bytes (paths and archive names).
        size = {name: checkpoint_bytes(ckpt) for name, ckpt in places.items()}
        assert abs(size["s3"] - size["local"]) < 1024, size
    medians = {
        name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in rounds.items()
    }
    result.update(
        model={"parameters": params, "checkpoint_bytes": size, "layout": "4 blocks, dim 256, 4 heads, vocab 257"},
        rounds=rounds,
        median=medians,
        ratio_s3_over_local={key: medians["s3"][key] / medians["local"][key] for key in medians["local"]},
    )
    result["environment"]["loadavg_at_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    for key in ("save_s", "load_s", "verify_s", "read_s", "pin_s"):
        print(
            f"{key:9s} local {medians['local'][key]:.3f} s   s3 {medians['s3'][key]:.3f} s   "
            f"ratio {result['ratio_s3_over_local'][key]:.2f}"
        )
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["save_s", "load_s", "pin_s"]
    med = result["median"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.35
    for i, (name, color) in enumerate((("local", "#4c72b0"), ("s3", "#dd8452"))):
        xs = [k + (i - 0.5) * width for k in range(len(keys))]
        bars = ax.bar(xs, [med[name][k] for k in keys], width, label="local disk" if name == "local" else "S3 (moto, loopback)", color=color)
        ax.bar_label(bars, fmt="%.2f s", fontsize=8)
    labels = {"save_s": "save", "load_s": "load incl. verify", "pin_s": "PBT pin"}
    ratio = result["ratio_s3_over_local"]
    ax.set_xticks(range(len(keys)), [f"{labels[k]}\n(x{ratio[k]:.1f})" for k in keys])
    ax.set_ylabel("seconds (median)")
    mib = result["model"]["checkpoint_bytes"]["local"] / 2**20
    ax.set_title(f"Checkpoint of the reference model ({mib:.0f} MiB, model + AdamW), one process", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
