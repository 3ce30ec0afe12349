"""`raytrain train` on Ray with `run_dir` and `data.path` in a bucket of a local S3 server (moto, loopback,
started here; credentials from the environment): a worker SIGKILLed inside a checkpoint save, the run
restarts from the last committed checkpoint and ends with the losses of the same run on local disk; then
the 2-worker run saved in the bucket resumes on 1 worker exactly as the local one does."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from raytrain_ext.cli import main
from raytrain_ext.launcher import wait_for
from tests.conftest import tiny_raw
from trainers.metrics import read_metrics
from trainers.storage import location, upload_folder

pytest.importorskip("moto")
pytest.importorskip("s3fs")
pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("own_cache")]

STEPS, EVERY = 8, 2


def _write_run(tmp_path, name, run_dir, data):
    raw = tiny_raw(
        data, run_dir,
        parallel={"engine": "ddp"},
        scaling={"num_workers": 2, "max_failures": 1},
        train={"steps": STEPS, "eval_every": 0},
        checkpoint={"every": EVERY, "keep": 2},
    )
    raw["run_dir"], raw["data"]["path"] = str(run_dir), str(data)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _losses(run_dir, first=1):
    rows = read_metrics(location(run_dir) / "metrics.jsonl", "train")
    return [r["step"] for r in rows if r["step"] >= first], [r["loss"] for r in rows if r["step"] >= first]


@pytest.mark.slow  # ~90 s on 2 cores: four Ray runs, one with a restart
def test_sigkill_inside_a_save_to_a_bucket_then_resume_at_one_worker(ray_on_s3, s3, corpus_dir, tmp_path):
    local = tmp_path / "local"
    local_run = _write_run(tmp_path, "local", local, corpus_dir)
    assert main(["train", local_run, "--no-progress"]) == 0

    bucket = s3.make_bucket()
    data = f"s3://{bucket}/data/stdlib"
    upload_folder(corpus_dir, location(data))
    uri = f"s3://{bucket}/runs/tiny"
    marks = tmp_path / "marks"
    run = _write_run(tmp_path, "bucket", uri, data)
    argv = ["train", run, "--no-progress", "--callback",
            f"tests.ray.hooks:KillMeMidSave(step=6, rank=1, marker_dir={str(marks)!r})"]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(main, argv)
        wait_for(lambda: (marks / "pid").exists() or future.done(), 240, "rank 1 inside the save of step 6")
        assert not future.done(), future.result()
        os.kill(int((marks / "pid").read_text()), signal.SIGKILL)
        assert future.result(timeout=300) == 0

    cut = json.loads((marks / "listing.json").read_text())
    assert [n for n in cut if n.endswith(".distcp")] and "COMMITTED" not in cut, "killed mid-save, uncommitted"
    events = read_metrics(location(uri) / "metrics.jsonl", "event")
    resumes = [(e["step"], e["checkpoint"]) for e in events if e["event"] == "resume"]
    assert resumes == [(4, f"{uri}/checkpoints/step_00000004")], "the half-written step 6 was never loaded"
    assert _losses(uri) == _losses(local), "each step once, bit for bit the local run's losses"
    committed = sorted(k.split("/")[3] for k in s3.keys(bucket, "runs/tiny/checkpoints/") if k.endswith("COMMITTED"))
    assert committed == ["step_00000006", "step_00000008"], "retention (keep=2) in the bucket"
    # Ray's run of this invocation, in the bucket too, holds a pointer to our newest checkpoint (no tensors)
    held = [json.loads(location(f"s3://{bucket}/{k}").read_text()) for k in s3.keys(bucket, "runs/tiny/ray/")
            if k.endswith("/pointer.json")]
    assert max(held, key=lambda p: p["step"])["uri"] == f"{uri}/checkpoints/step_00000008"
    assert not [k for k in s3.keys(bucket, "runs/tiny/ray/") if k.endswith(".distcp")]

    # Done-when 2: the 2-worker run in the bucket resumes on 1 worker, as the local one does.
    more = ["--no-progress", "--set", "scaling.num_workers=1", "--set", f"train.steps={STEPS + 4}"]
    assert main(["train", local_run, *more]) == 0
    assert main(["train", run, *more]) == 0
    resize = [e for e in read_metrics(location(uri) / "metrics.jsonl", "event") if e["event"] == "resize"]
    assert [(e["step"], e["old_world_size"], e["new_world_size"]) for e in resize] == [(STEPS, 2, 1)]
    assert _losses(uri, STEPS + 1) == _losses(local, STEPS + 1)
    assert _losses(uri)[0] == list(range(1, STEPS + 5))
