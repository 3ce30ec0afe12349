"""Runs on object storage without Ray, against a local S3 server (moto, loopback, started here): the
checkpoint commit protocol (marker last, a save cut short never loads, retention in the bucket), a run that
trains to a bucket and resumes from it with the losses of a local run, token shards read from the bucket
(checksums verified, with and without the local cache), `data prepare --output s3://`, and the one-line
errors (exit 2) for a missing bucket, missing credentials and a denied write."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import yaml

import raytrain_ext.worker  # noqa: F401  at collection: a first `import ray` sets RAY_CLIENT_MODE (the leak guard)
from tests.conftest import tiny_raw
from tests.s3_server import NO_CREDENTIALS, clear_clients
from trainers.checkpoint import Checkpointer, ModelOptimizerState, is_complete
from trainers.config import parse_config
from trainers.data.dataset import TokenWindows
from trainers.launch import run_local
from trainers.metrics import read_metrics
from trainers.storage import location

pytest.importorskip("moto")
pytest.importorskip("s3fs")
pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture(scope="module")
def s3_corpus(s3, corpus_dir):
    """The session's corpus, uploaded as `raytrain data prepare --output s3://` would leave it."""
    from trainers.storage import upload_folder

    bucket = s3.make_bucket("data")
    uri = f"s3://{bucket}/stdlib"
    upload_folder(corpus_dir, location(uri))
    return uri


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoints_in_a_bucket_commit_last_retain_and_load_exactly(s3):
    bucket = s3.make_bucket()
    root = location(f"s3://{bucket}/run/checkpoints")
    ckpt = Checkpointer(root, keep=2)
    model, opt = _model()
    rng_state = torch.get_rng_state()
    for step in (2, 4, 6):
        ckpt.save(step, {"app": ModelOptimizerState(model, opt)}, {"step": step}, rng={"torch": rng_state})
    assert [p.name for p in ckpt.candidates()] == ["step_00000006", "step_00000004"]
    keys = s3.keys(bucket, "run/checkpoints/")
    assert not [k for k in keys if "step_00000002" in k], "retention deleted the oldest in the bucket"
    assert "run/checkpoints/step_00000006/COMMITTED" in keys and not [k for k in keys if ".sums" in k]
    assert Checkpointer.verify(ckpt.latest()) is None

    fresh = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state, rng = ckpt.load(ckpt.latest(), {"app": ModelOptimizerState(fresh, fresh_opt)})
    assert state == {"step": 6} and torch.equal(rng["torch"], rng_state)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])


def test_a_save_cut_short_is_never_loaded_and_is_cleaned_up(s3):
    bucket = s3.make_bucket()
    ckpt = Checkpointer(location(f"s3://{bucket}/run/checkpoints"), keep=3)
    model, opt = _model()
    state = {"app": ModelOptimizerState(model, opt)}
    ckpt.save(2, state, {"step": 2})

    class Killed(Exception):
        pass

    def crash(partial):  # everything written but the marker: the process dies here
        raise Killed

    with pytest.raises(Killed):
        ckpt.save(4, state, {"step": 4}, before_commit=crash)
    cut = location(f"s3://{bucket}/run/checkpoints/step_00000004")
    assert [k for k in s3.keys(bucket, "run/checkpoints/step_00000004/") if k.endswith(".distcp")]
    assert not is_complete(cut) and [p.name for p in ckpt.candidates()] == ["step_00000002"]

    # A damaged committed checkpoint is found by its checksums.
    victim = max(
        (k for k in s3.keys(bucket, "run/checkpoints/step_00000002/") if k.endswith(".distcp")),
        key=lambda k: s3.client().head_object(Bucket=bucket, Key=k)["ContentLength"],
    )
    body = s3.client().get_object(Bucket=bucket, Key=victim)["Body"].read()
    s3.client().put_object(Bucket=bucket, Key=victim, Body=body[:50])
    problem = Checkpointer.verify(ckpt.latest())
    assert problem is not None and "has 50 bytes" in problem
    s3.client().put_object(Bucket=bucket, Key=victim, Body=body)

    ckpt.save(6, state, {"step": 6})  # the next commit's retention removes what the crash left
    assert not s3.keys(bucket, "run/checkpoints/step_00000004/")
    ckpt.save(4, state, {"step": 4})  # and saving that step again replaces a leftover cleanly
    # (newest commit first: a run that saves step 4 after step 6 went back to 4)
    assert [p.name for p in ckpt.candidates()] == ["step_00000004", "step_00000006", "step_00000002"]


def test_token_shards_from_a_bucket_match_local_with_and_without_cache(s3, s3_corpus, corpus_dir, tmp_path):
    local = TokenWindows(corpus_dir, "train", 32)
    cached = TokenWindows(s3_corpus, "train", 32, cache=True)
    assert (cached.tokens == local.tokens).all()
    assert list((tmp_path / "cache" / "blobs").iterdir()), "shards copied once into the local cache"
    direct = TokenWindows(s3_corpus, "val", 32, cache=False)
    assert (direct.tokens == TokenWindows(corpus_dir, "val", 32).tokens).all()

    # A shard changed in the bucket after prepare: one line naming it, cache or not.
    manifest = json.loads(location(s3_corpus + "/manifest.json").read_text())
    shard = manifest["splits"]["val"]["shards"][0]["file"]
    bucket, prefix = s3_corpus[len("s3://") :].split("/", 1)
    original = s3.client().get_object(Bucket=bucket, Key=f"{prefix}/{shard}")["Body"].read()
    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0xFF
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}/{shard}", Body=bytes(changed))
    try:
        for cache in (True, False):
            with pytest.raises(Exception, match="does not match its sha256"):
                TokenWindows(s3_corpus, "val", 32, cache=cache)
    finally:
        s3.client().put_object(Bucket=bucket, Key=f"{prefix}/{shard}", Body=original)


def test_data_prepare_writes_to_a_bucket(s3, tmp_path):
    from raytrain_ext.cli import main

    bucket = s3.make_bucket("prep")
    text = tmp_path / "texts"
    text.mkdir()
    (text / "a.py").write_text("def f(x):\n    return x + 1\n" * 200)
    (text / "b.py").write_text("class A:\n    pass\n" * 200)
    uri = f"s3://{bucket}/corpus"
    assert main(["data", "prepare", "--input", str(text), "--output", uri, "--no-progress", "--val-fraction", "0.5"]) == 0
    keys = s3.keys(bucket, "corpus/")
    assert "corpus/manifest.json" in keys and any(k.endswith(".parquet") for k in keys)
    assert TokenWindows(uri, "train", 16).num_windows > 0


def _run_yaml(tmp_path, corpus, run_dir, **sections):
    raw = tiny_raw(corpus, run_dir, **{"train": {"steps": 8, "eval_every": 4}, "checkpoint": {"every": 2, "keep": 2}, **sections})
    raw["run_dir"], raw["data"]["path"] = str(run_dir), str(corpus)
    path = tmp_path / f"run-{abs(hash(str(run_dir))) % 10**8}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return raw, path


def test_a_run_in_a_bucket_resumes_with_the_losses_of_a_local_run(s3, s3_corpus, corpus_dir, tmp_path):
    local_raw, _ = _run_yaml(tmp_path, corpus_dir, tmp_path / "local")
    run_local(parse_config(local_raw), progress=False)
    bucket = s3.make_bucket()
    uri = f"s3://{bucket}/runs/tiny"
    raw, _ = _run_yaml(tmp_path, s3_corpus, uri)
    from search.hooks import StopAtStep

    # Ends right after the commit of step 4 (checkpoints at 2 and 4), on the callback's request.
    stopped = run_local(parse_config(raw), callbacks=[StopAtStep(4)], progress=False)
    assert stopped.stopped and stopped.checkpoint.name == "step_00000004"
    result = run_local(parse_config(raw), progress=False)  # the same command again: on to step 8
    assert result.step == 8 and str(result.checkpoint) == f"{uri}/checkpoints/step_00000008"
    rows = read_metrics(location(uri) / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    ref = read_metrics(tmp_path / "local" / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == list(range(1, 9)), "each step once in the bucket's metrics.jsonl"
    assert [r["loss"] for r in train] == [r["loss"] for r in ref], "bit for bit the local run's losses"
    (resume,) = [r for r in rows if r.get("event") == "resume"]
    assert resume["step"] == 4 and resume["checkpoint"] == f"{uri}/checkpoints/step_00000004"
    names = {k.split("/")[3] for k in s3.keys(bucket, "runs/tiny/checkpoints/")}
    assert names == {"step_00000006", "step_00000008"}, "keep=2, in the bucket"
    assert location(uri + "/config.yaml").is_file()

    # `raytrain export` from the bucket's run to the bucket: the newest checkpoint, bit for bit, and the
    # tokenizer from the bucket's data folder.
    from safetensors.torch import load_file

    from raytrain_ext.cli import main

    out = f"s3://{bucket}/export/tiny"
    assert main(["export", uri, out]) == 0
    exported = {k.split("/")[-1] for k in s3.keys(bucket, "export/tiny/")}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= exported
    local_out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "local"), str(local_out)]) == 0
    body = s3.client().get_object(Bucket=bucket, Key="export/tiny/model.safetensors")["Body"].read()
    (tmp_path / "from-bucket.safetensors").write_bytes(body)
    ours, ref = load_file(tmp_path / "from-bucket.safetensors"), load_file(local_out / "model.safetensors")
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.parametrize("command", ["train", "tune"])
@pytest.mark.parametrize("case", ["missing bucket", "no credentials", "denied write"])
def test_bad_bucket_errors_are_one_line_exit_2_before_any_worker(
    case, command, s3, s3_corpus, corpus_dir, tmp_path, capsys, monkeypatch
):
    import ray
    from moto.core.authorization import enable_iam_authentication

    from raytrain_ext.cli import main

    bucket = s3.make_bucket()
    run_dir = f"s3://{bucket}/runs/x"
    enforced = contextlib.nullcontext()
    if case == "missing bucket":
        run_dir = "s3://no-such-bucket-raytrain/runs/x"
    elif case == "no credentials":
        for key in NO_CREDENTIALS:
            monkeypatch.delenv(key, raising=False)
    else:
        _read_only_keys(s3, bucket, monkeypatch)
        enforced = enable_iam_authentication()  # the server checks IAM policies from here on
    _, path = _run_yaml(tmp_path, s3_corpus if case != "no credentials" else corpus_dir, run_dir)
    argv = ["train", str(path), "--no-progress"]
    if command == "tune":  # an experiment whose storage is there: the same line, naming `storage`
        path = _experiment_yaml(tmp_path, path, run_dir.rsplit("/", 1)[0])
        argv = ["tune", str(path), "--quiet"]
    try:
        with enforced:
            code = main(argv)
    finally:
        clear_clients()
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    field = "run_dir" if command == "train" else "storage"
    assert line.startswith(f"raytrain: error: {field}=s3://") and "fix:" in line
    expected = {"missing bucket": "no bucket no-such-bucket-raytrain", "no credentials": "no credentials",
                "denied write": "permission denied"}[case]
    assert expected in line, line
    assert not ray.is_initialized(), "refused before Ray (and any worker) started"


def _experiment_yaml(tmp_path, base, storage: str, **more):
    exp = {
        "name": "x",
        "base": str(base),
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        "scheduler": {"name": "pbt", "interval": 4},
        "population": 2,
        "budget": {"steps": 8},
        "storage": storage,
        **more,
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def test_mlflow_local_store_with_a_bucket_is_one_line(s3, s3_corpus, tmp_path, capsys):
    from raytrain_ext.cli import main

    bucket = s3.make_bucket()
    raw, path = _run_yaml(tmp_path, s3_corpus, f"s3://{bucket}/runs/x")
    raw["tracking"] = {"mlflow": {}}
    path.write_text(yaml.safe_dump(raw))
    exp = _experiment_yaml(tmp_path, path, f"s3://{bucket}/tune")
    for argv in (["train", str(path), "--no-progress"], ["tune", str(exp), "--quiet"]):
        assert main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "tracking.mlflow without tracking_uri" in line and "fix: set tracking.mlflow.tracking_uri" in line


def test_report_of_an_experiment_in_a_missing_bucket_or_without_credentials_is_one_line(s3, capsys, monkeypatch):
    from raytrain_ext.cli import main

    assert main(["tune", "report", "s3://no-such-bucket-raytrain/tune/x"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "EXP_DIR=s3://no-such-bucket-raytrain/tune/x: no bucket no-such-bucket-raytrain" in line, line
    for key in NO_CREDENTIALS:
        monkeypatch.delenv(key, raising=False)
    try:
        assert main(["tune", "report", "s3://b-any/tune/x"]) == 2
    finally:
        clear_clients()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "no credentials" in line and "fix:" in line, line


def _read_only_keys(s3, bucket, monkeypatch):
    """Credentials that may read the bucket but not write to it: an IAM user with a read-only policy."""
    import boto3

    iam = boto3.client("iam", endpoint_url=s3.endpoint, region_name="us-east-1")
    user = f"reader-{bucket}"
    iam.create_user(UserName=user)
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetObject", "s3:ListAllMyBuckets",
                                                      "s3:GetBucketLocation"], "Resource": "*"}],
    }
    iam.put_user_policy(UserName=user, PolicyName="read-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])


def test_a_uri_run_dir_and_data_path_survive_the_config_round_trip(s3_corpus, tmp_path):
    raw = tiny_raw(s3_corpus, "s3://bucket/runs/x")
    raw["run_dir"] = "s3://bucket/runs/x/"
    cfg = parse_config(raw)
    assert str(cfg.out_dir) == "s3://bucket/runs/x" and str(cfg.data.path) == s3_corpus
    again = parse_config(json.loads(cfg.model_dump_json()))
    assert str(again.out_dir) == "s3://bucket/runs/x" and yaml.safe_load(cfg.to_yaml())["run_dir"] == "s3://bucket/runs/x"
    local = parse_config(tiny_raw(s3_corpus, tmp_path / "r"))
    assert local.out_dir == tmp_path / "r" and isinstance(local.out_dir, os.PathLike)


def test_a_rewound_log_in_a_bucket_is_read_again_even_when_it_grew_past_the_old_offset(s3):
    """A restart rewinds metrics.jsonl to its checkpoint and appends again; a store has no inode, and by the
    next look the new object may be longer than what was read: its first bytes differ, so it is read from 0."""
    from trainers.storage import read_appended, write_text_atomic

    path = location(f"s3://{s3.make_bucket('log')}/run/metrics.jsonl")
    write_text_atomic(path, "step 1\nstep 2\nstep 3\n")
    data, offset, version = read_appended(path, 0)
    assert (data, offset) == (b"step 1\nstep 2\nstep 3\n", 0)
    offset = len(data)
    write_text_atomic(path, "step 1\nresume 1\nstep 2 again\nstep 3 again\n")  # rewound to step 1, then more
    data, offset, version = read_appended(path, offset, version)
    assert offset == 0 and data.startswith(b"step 1\nresume 1\n")
    offset = len(data)
    write_text_atomic(path, "step 1\nresume 1\nstep 2 again\nstep 3 again\nstep 4\n")  # appended only
    data, offset, _ = read_appended(path, offset, version)
    assert (data, offset) == (b"step 4\n", len(b"step 1\nresume 1\nstep 2 again\nstep 3 again\n"))
