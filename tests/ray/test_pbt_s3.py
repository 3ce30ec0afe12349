"""A PBT experiment whose `storage` and data are in a bucket of a local S3 server (moto on loopback, started
here; credentials from the environment), run with `raytrain tune` as a user would on a cluster without a
shared file system:

- the weaker trial exploits the stronger one in place (synchronous PBT at the first interval): its next
  loss is the donor's, read from the run's metrics in the bucket; the experiment, interrupted after the
  exploit (SIGINT, as Ctrl-C), continues with `raytrain tune --resume` from the bucket to the same end,
  with the exploit once;
- every file of the experiment is in the bucket (Tune's state and metadata-only checkpoints, the pins made
  by the store's own copies, the lineage logs and tables), nothing in the local folders;
- `raytrain tune report s3://...` writes its plots and summary there, and `raytrain tune replay s3://...`
  retrains the exploited trial's schedule from scratch to the loss it reported.
"""

from __future__ import annotations

import json
import os

import pytest

from raytrain_ext.cli import main
from search.config import load_experiment
from search.lineage import read_events, read_reports
from search.replay import replay
from tests.ray.test_pbt import INTERVAL, STEPS, InterruptAfterExploit, _train_rows, _trial_of
from tests.ray.test_pbt import _experiment as pbt_experiment
from trainers.storage import location, upload_folder

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("own_cache")]


def _experiment(tmp, data: str, storage: str, name: str, **more):
    return pbt_experiment(
        tmp,
        data,
        name,
        {"name": "adamw", "lr": 1e-3},
        {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        [{"optimizer.lr": 1e-2}, {"optimizer.lr": 1e-4}],
        storage=storage,
        keep_checkpoints=1,
        **more,
    )


@pytest.fixture(scope="module")
def data_in_bucket(s3, corpus_dir):
    bucket = s3.make_bucket()
    data = f"s3://{bucket}/data/stdlib"
    upload_folder(corpus_dir, location(data))
    return bucket, data


@pytest.mark.slow  # ~3 min on 2 cores (the default tier keeps the bucket unit tests: storage_s3, hf_s3, cluster_storage)
def test_pbt_in_a_bucket_interrupted_after_the_exploit_resumes_reports_and_replays(
    ray_on_s3, s3, data_in_bucket, tmp_path, capsys
):
    from search.config import save
    from search.driver import run_experiment

    bucket, data = data_in_bucket
    uri = f"s3://{bucket}/tune/pbt"
    path = _experiment(tmp_path, data, f"s3://{bucket}/tune", "pbt", callbacks=["tests.ray.hooks:HoldOnceFromDonor()"])
    exp = load_experiment(path)
    save(exp)
    cwd = os.getcwd()
    os.chdir(tmp_path)  # a relative path written by mistake would land here
    try:
        # Ctrl-C once the exploited trial holds at its first step from the donor; `raytrain tune --resume`
        # continues from the bucket to the end
        first = run_experiment(exp, verbose=0, callbacks=[InterruptAfterExploit(exp.exp_dir)])
        errors = [r.get("error") for r in first.reports if r.get("failed")]
        assert not first.finished and len(first.events) == 1, errors
        assert main(["tune", str(path), "--resume", "--quiet"]) == 0
    finally:
        os.chdir(cwd)
    exp_dir = location(uri)

    # The exploit, once (after the resume too), in place, from the donor's pin in the bucket: the exploited
    # trial's steps after it are the donor's continuation, however the interrupt split the runs.
    strong, weak = _trial_of(exp_dir, 1e-2), _trial_of(exp_dir, 1e-4)
    (event,) = read_events(exp_dir)
    assert (event["trial"], event["donor"], event["step"]) == (weak, strong, INTERVAL)
    weak_rows, strong_rows = _train_rows(exp_dir, weak), _train_rows(exp_dir, strong)
    assert weak_rows[INTERVAL + 1]["loss"] == pytest.approx(strong_rows[INTERVAL + 1]["loss"], rel=1e-6)
    assert weak_rows[INTERVAL]["loss"] > strong_rows[INTERVAL + 1]["loss"] + 0.5
    assert sorted(weak_rows) == list(range(1, STEPS + 1)), "each step once in the runs' metrics"
    last = {r["trial"]: r for r in sorted(read_reports(exp_dir), key=lambda r: r["time"])}
    assert len(last) == 2 and {r["step"] for r in last.values()} == {STEPS}
    assert last[weak]["hparams"] != {"optimizer.lr": 1e-4} and not last[weak]["failed"]

    # Everything in the bucket: Tune's state (no checkpoint of ours), the pins, the lineage.
    keys = s3.keys(bucket, "tune/pbt/")
    names = {k.removeprefix("tune/pbt/") for k in keys}
    assert {"experiment.json", "tuner.pkl", "reports.parquet", "lineage.parquet"} <= names
    assert {f"lineage/{strong}.jsonl", f"lineage/{weak}.jsonl"} <= names
    assert not [k for k in keys if k.startswith("tune/pbt/TrialRun_") and "/checkpoint_0" in k]
    pin = location(event["pin"])  # the exploit's record names the recipient's copy of the donor's checkpoint
    assert event["pin"].startswith(f"s3://{bucket}/tune/pbt/runs/{weak}/pins/")
    meta = json.loads((pin / "meta.json").read_text())
    assert meta["trial"] == strong and (pin / meta["step_dir"] / "COMMITTED").is_file(), "a committed copy"
    # Retention (keep_checkpoints=1) deletes pins in the bucket too: at most the newest and one an exploit
    # may still need, of the 2-3 each trial made.
    pins = {t: {k.split("/")[5] for k in keys if k.startswith(f"tune/pbt/runs/{t}/pins/")} for t in (strong, weak)}
    assert all(1 <= len(p) <= 2 for p in pins.values()), pins
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tune").exists()

    # report: plots and summary written to the bucket.
    capsys.readouterr()
    assert main(["tune", "report", uri]) == 0
    out = capsys.readouterr().out
    assert "exploits: 1" in out and f"{uri}/report/population.png" in out
    sizes = {k.rsplit("/", 1)[-1]: s for k, s in _sizes(s3, bucket, "tune/pbt/report/").items()}
    assert set(sizes) == {"population.png", "hparams.png", "lineage.png", "summary.txt"}
    assert min(sizes[n] for n in ("population.png", "hparams.png", "lineage.png")) > 10_000

    # replay: the exploited trial's schedule (the donor's lr to step 10, then its explored one), from
    # scratch as one run in the bucket, lands on the loss the trial reported.
    rep = replay(exp_dir, weak)
    assert [s for s, _ in rep.schedule.changes] == [0, INTERVAL]
    assert rep.schedule.changes[0][1] == {"optimizer.lr": 1e-2}
    assert str(rep.run_dir).startswith(f"{uri}/replay/")
    assert rep.replayed == pytest.approx(rep.reported, rel=1e-5)


def _sizes(s3, bucket: str, prefix: str) -> dict[str, int]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {obj["Key"]: obj["Size"] for page in pages for obj in page.get("Contents", [])}
