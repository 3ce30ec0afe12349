"""The cloud cluster files keep runs in a bucket by default and reach it through the nodes' roles (no keys):
`raytrain cluster check` validates them and names what breaks that; the README walk-through uses the bucket;
RAYTRAIN_STORAGE (which those files set) becomes the default run_dir."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import ray.autoscaler  # noqa: F401  at collection: a first `import ray` sets RAY_CLIENT_MODE (the leak guard)
import yaml

from raytrain_ext.cli import main
from raytrain_ext.cluster import policy_findings
from tests.conftest import tiny_raw
from trainers.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "clusters"


@pytest.mark.parametrize("name, scheme, key", [("aws-gpu.yaml", "s3://", "IamInstanceProfile"),
                                               ("gcp-gpu.yaml", "gs://", "serviceAccounts")])
def test_cloud_cluster_files_use_a_bucket_through_roles(name, scheme, key, tmp_path, capsys):
    path = CLUSTERS / name
    assert main(["cluster", "check", str(path)]) == 0, capsys.readouterr()
    raw = yaml.safe_load(path.read_text())
    assert any(f"RAYTRAIN_STORAGE={scheme}" in o for o in raw["docker"]["run_options"])
    assert all(key in t["node_config"] for t in raw["available_node_types"].values())
    assert any("--output $RAYTRAIN_STORAGE/data" in c for c in raw["head_setup_commands"])

    worker = next(n for n in raw["available_node_types"] if n != "head")
    del raw["available_node_types"][worker]["node_config"][key]
    raw["docker"]["run_options"] = [o for o in raw["docker"]["run_options"] if "RAYTRAIN_STORAGE" not in o]
    bad = tmp_path / name
    bad.write_text(yaml.safe_dump(raw))
    findings = " | ".join(policy_findings(bad))
    assert f"node type {worker} has no {key}" in findings and "no default bucket" in findings


def test_iam_policies_give_the_bucket_only():
    worker = json.loads((CLUSTERS / "iam" / "aws-bucket-policy.json").read_text())
    actions = {a for s in worker["Statement"] for a in s["Action"]}
    resources = {s["Resource"] for s in worker["Statement"]}
    assert actions <= {"s3:ListBucket", "s3:GetBucketLocation", "s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                       "s3:AbortMultipartUpload"}
    assert resources == {"arn:aws:s3:::my-raytrain-bucket", "arn:aws:s3:::my-raytrain-bucket/*"}


def test_the_cluster_walk_through_uses_the_bucket():
    text = (CLUSTERS / "README.md").read_text()
    walk = text[text.index("## From `ray up` to a result") : text.index("## KubeRay")]
    submit = [line for line in walk.splitlines() if line.strip().startswith("raytrain train")]
    assert submit and all("s3://" in line for line in submit), submit
    assert "aws s3 mb s3://" in walk and "iam/aws-bucket-policy.json" in walk
    assert not re.search(r"AWS_SECRET_ACCESS_KEY=\S", walk), "no keys in the walk-through"


def test_raytrain_storage_is_the_default_run_dir(corpus_dir, monkeypatch):
    raw = tiny_raw(corpus_dir, "unused")
    del raw["run_dir"]
    assert parse_config(raw).out_dir == Path("runs") / "t"
    monkeypatch.setenv("RAYTRAIN_STORAGE", "s3://my-bucket/")
    pytest.importorskip("upath")
    pytest.importorskip("s3fs")
    assert str(parse_config(raw).out_dir) == "s3://my-bucket/runs/t"
