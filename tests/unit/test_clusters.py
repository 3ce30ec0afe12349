"""Cluster files (clusters/): each passes Ray's own validator and our promises (token auth, dashboard off the
internet, pinned versions, no secret); misspelt keys are named; `raytrain cluster check` verdicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import ray.autoscaler  # noqa: F401  at collection: a first `import ray` sets RAY_CLIENT_MODE (the leak guard)
import yaml

from raytrain_ext.cli import main
from raytrain_ext.cluster import ClusterError, check_run, load_cluster, policy_findings
from trainers.config import parse_config

CLUSTERS = Path(__file__).resolve().parents[2] / "clusters"
FILES = sorted(CLUSTERS.glob("*.yaml"))


def test_the_expected_cluster_files_exist():
    assert {f.name for f in FILES} == {"aws-gpu.yaml", "gcp-gpu.yaml", "local.yaml", "kuberay.yaml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_cluster_file_passes_rays_validator(path):
    cluster = load_cluster(path)  # ray up: schema + prepare_config + validate_config; KubeRay: Ray's translation
    assert cluster.gpu_types, "each cluster has GPU workers"
    assert all(t.gpus == 0 for t in cluster.node_types if t.head), "the head trains nothing"
    assert all(t.accelerator for t in cluster.gpu_types), "GPU types declare accelerator_type for the planner"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_cluster_file_keeps_its_promises(path):
    assert policy_findings(path) == []


def test_local_provider_sets_no_node_types_and_ray_refuses_them(tmp_path):
    raw = yaml.safe_load((CLUSTERS / "local.yaml").read_text())
    assert "available_node_types" not in raw and "head_node_type" not in raw
    raw["available_node_types"] = {"gpu": {"node_config": {}, "resources": {"GPU": 8}}}
    bad = tmp_path / "local.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ClusterError, match="available_node_types"):
        load_cluster(bad)


def _misspell(tmp_path: Path, name: str, edit) -> Path:
    raw = yaml.safe_load((CLUSTERS / name).read_text())
    edit(raw)
    out = tmp_path / name
    out.write_text(yaml.safe_dump(raw))
    return out


def _rename(mapping: dict[str, Any], old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


@pytest.mark.parametrize(
    "name, edit, key, fix",
    [
        ("aws-gpu.yaml", lambda r: _rename(r["available_node_types"]["gpu-h100x8"], "max_workers", "max_worker"),
         "available_node_types.gpu-h100x8.max_worker", "max_workers"),
        ("gcp-gpu.yaml", lambda r: _rename(r, "idle_timeout_minutes", "idle_timeout_minute"),
         "idle_timeout_minute", "idle_timeout_minutes"),
        ("local.yaml", lambda r: _rename(r, "file_mounts", "file_mount"), "file_mount", "file_mounts"),
        ("kuberay.yaml", lambda r: _rename(r["spec"]["workerGroupSpecs"][0], "maxReplicas", "maxReplica"),
         "spec.workerGroupSpecs[0].maxReplica", "maxReplicas"),
    ],
)
def test_a_misspelt_key_is_rejected_with_the_key_named(tmp_path, capsys, name, edit, key, fix):
    bad = _misspell(tmp_path, name, edit)
    with pytest.raises(ClusterError) as err:
        load_cluster(bad)
    assert f"unknown key '{key}'" in str(err.value) and f"did you mean '{fix}'" in str(err.value)
    assert main(["cluster", "check", str(bad)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and key in lines[0]


def test_rays_schema_rejects_a_wrong_type(tmp_path):
    bad = _misspell(tmp_path, "aws-gpu.yaml", lambda r: r.update(max_workers="many"))
    with pytest.raises(ClusterError, match="max_workers: 'many' is not of type 'integer'"):
        load_cluster(bad)


def test_a_literal_token_is_a_finding(tmp_path):
    raw = yaml.safe_load((CLUSTERS / "aws-gpu.yaml").read_text())
    raw["worker_start_ray_commands"][-1] = "export RAY_AUTH_TOKEN=abc123; " + raw["worker_start_ray_commands"][-1]
    raw["head_start_ray_commands"][-1] = raw["head_start_ray_commands"][-1].replace("127.0.0.1", "0.0.0.0")
    bad = tmp_path / "aws.yaml"
    bad.write_text(yaml.safe_dump(raw))
    findings = " | ".join(policy_findings(bad))
    assert "a literal Ray token" in findings and "not bound to 127.0.0.1" in findings


@pytest.mark.parametrize("name", ["local.yaml", "aws-gpu.yaml", "kuberay.yaml"])
def test_a_head_without_the_health_checks_is_a_finding(tmp_path, name):
    """A lost host is declared dead in ~10-25 s only with the health checks the cluster tier measured."""
    text = (CLUSTERS / name).read_text()
    assert "RAY_health_check_timeout_ms" in text
    bad = tmp_path / name
    bad.write_text(text.replace("RAY_health_check_timeout_ms", "RAY_unrelated_setting"))
    assert any("RAY_health_check_timeout_ms" in f for f in policy_findings(bad)), policy_findings(bad)


# ----------------------------------------------------------------------------------- cluster check


def run(**sections: dict[str, Any]) -> Any:
    raw: dict[str, Any] = {
        "model": {"vocab_size": 32000, "dim": 2048, "n_layers": 16, "n_heads": 16, "max_seq_len": 2048},
        "data": {"path": "not-read", "seq_len": 2048},
        "parallel": {"engine": "fsdp", "zero_stage": 3},
        "precision": {"dtype": "bf16"},
        "train": {"global_batch_size": 64, "micro_batch_size": 2, "steps": 10},
        "scaling": {"num_workers": 16, "use_gpu": True},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return parse_config(raw)


def _failed(verdict) -> dict[str, str]:
    return {c.name: c.message for c in verdict.checks if not c.ok}


def test_a_run_that_fits():
    verdict = check_run(load_cluster(CLUSTERS / "aws-gpu.yaml"), run())
    assert verdict.fits, _failed(verdict)
    assert {c.name for c in verdict.checks} >= {"cluster size", "layout", "gpus per node", "elastic range",
                                                "memory per GPU"}


def test_wrong_gpu_count_per_node():
    # 12 workers: a part-empty 8-GPU node, and more than the 4-GPU type's 2 x 4
    verdict = check_run(load_cluster(CLUSTERS / "aws-gpu.yaml"), run(scaling={"num_workers": 12},
                                                                     train={"global_batch_size": 48}))
    assert not verdict.fits and set(_failed(verdict)) == {"gpus per node"}
    assert "12 is not a multiple of its 8 GPUs per node" in _failed(verdict)["gpus per node"]


def test_pipeline_times_data_larger_than_the_cluster():
    cfg = run(scaling={"num_workers": 48}, parallel={"pp": 2}, train={"global_batch_size": 96})  # 2 x 24
    verdict = check_run(load_cluster(CLUSTERS / "kuberay.yaml"), cfg)
    failed = _failed(verdict)
    assert not verdict.fits and "cluster size" in failed
    assert "world size 48 (pp=2 x dp=24) is larger than the cluster's maximum of 40 GPUs" in failed["cluster size"]


def test_elastic_range_against_node_types():
    # 4..8 workers on the 4-GPU type (whole nodes give 4 or 8), every size a valid layout (840 = lcm 4..8 x 1)
    elastic = run(scaling={"num_workers": None, "min_workers": 4, "max_workers": 8},
                  train={"global_batch_size": 840, "micro_batch_size": 1})
    verdict = check_run(load_cluster(CLUSTERS / "gcp-gpu.yaml"), elastic)
    assert verdict.fits, _failed(verdict)
    too_many = run(scaling={"num_workers": None, "min_workers": 41, "max_workers": 42},
                   train={"global_batch_size": 41 * 42, "micro_batch_size": 1})
    failed = _failed(check_run(load_cluster(CLUSTERS / "gcp-gpu.yaml"), too_many))
    assert "min_workers=41 can never be placed" in failed["elastic range"]


def test_memory_that_does_not_fit_names_a_change():
    big = run(model={"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672},
              scaling={"num_workers": 32})
    failed = _failed(check_run(load_cluster(CLUSTERS / "aws-gpu.yaml"), big))
    assert set(failed) == {"memory per GPU"} and "fix: --set " in failed["memory per GPU"]


def test_cli_cluster_check_exit_codes(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({**run().model_dump(mode="json"), "run_dir": None}))
    assert main(["cluster", "check", str(CLUSTERS / "local.yaml"), "--run", str(path)]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["cluster", "check", str(CLUSTERS / "local.yaml"), "--run", str(path),
                 "--set", "scaling.num_workers=12", "--set", "train.global_batch_size=48"]) == 1
    assert "does NOT fit" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["plan", "--help"], ["cluster", "--help"], ["cluster", "check", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "usage: raytrain" in capsys.readouterr().out


def test_a_tensor_parallel_group_must_fit_in_a_node():
    # 8 workers reach both node types of aws-gpu.yaml (one 8-GPU node, two 4-GPU nodes): tp=4 divides both
    ok = check_run(load_cluster(CLUSTERS / "aws-gpu.yaml"), run(scaling={"num_workers": 8}, parallel={"tp": 4}))
    assert ok.fits, _failed(ok)
    assert "parallel.tp=4 groups fit in one node" in {c.name: c.message for c in ok.checks}["tp within a node"]
    # tp=8 would put a group across two 4-GPU nodes
    failed = _failed(check_run(load_cluster(CLUSTERS / "aws-gpu.yaml"),
                               run(scaling={"num_workers": 8}, parallel={"tp": 8})))
    assert set(failed) == {"tp within a node"}
    line = failed["tp within a node"]
    assert "\n" not in line and line.startswith("parallel.tp=8 does not divide the GPUs per node of gpu-l40sx4 (4 GPUs/")
    assert "fix: use parallel.tp in [1, 2, 4]" in line


def test_a_bad_layout_is_the_authoritys_line():
    # pp=2 x tp=2 at 6 workers: tp does not divide 6 / 2; the line is trainers.layout's, as `raytrain train`'s
    failed = _failed(check_run(load_cluster(CLUSTERS / "aws-gpu.yaml"),
                               run(scaling={"num_workers": 6}, parallel={"pp": 2, "tp": 2},
                                   train={"global_batch_size": 48})))
    assert failed["layout"].startswith("parallel.tp=2 does not divide the world size 6 / pp=2; fix:")
