"""Elastic run on a Ray cluster whose nodes come and go (`ray.cluster_utils.Cluster`): it starts on 1
worker, grows to 2 when a node joins, shrinks back to 1 when the node leaves, trains every sample exactly
once, and ends where a fixed-size run ends."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from raytrain_ext.cli import main
from raytrain_ext.launcher import wait_for
from tests.ray.conftest import RUNTIME_ENV, ray_env_restored
from tests.ray.test_train_on_ray import _losses, _write_run, assert_each_sample_once
from trainers.config import load_config
from trainers.launch import run_local
from trainers.metrics import read_metrics

pytestmark = pytest.mark.ray

STEPS, EVERY, BATCH = 30, 10, 8
# Elastic and fixed-size runs differ only in float summation order (measured: 1.2e-7 relative).
LOSS_RTOL = 1e-5


@pytest.fixture
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    with ray_env_restored():
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        # After a node is lost the controller first retries the old size; do not wait the default 60 s.
        env = {"env_vars": {**RUNTIME_ENV["env_vars"], "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}}
        try:
            ray.init(address=cluster.address, runtime_env=env, log_to_driver=False)
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.mark.slow  # 60 s on 2 cores; the default tier keeps a worker killed and resumed (test_train_on_ray.py)
def test_grow_then_shrink_keeps_data_order_and_loss(cluster, corpus_dir, tmp_path):
    run_dir = tmp_path / "elastic"
    run = _write_run(
        corpus_dir, run_dir, parallel={"engine": "fsdp"},
        scaling={"min_workers": 1, "max_workers": 2, "resize_check_s": 1, "max_failures": 3},
        train={"steps": STEPS, "eval_every": EVERY, "global_batch_size": BATCH, "micro_batch_size": 4},
        checkpoint={"every": EVERY, "keep": 2},
    )
    held = run_dir / "held"
    argv = ["train", str(run), "--no-progress", "--callback", "tests.ray.hooks:RecordSamples",
            "--callback", f"tests.ray.hooks:HoldAtCheckpoint(step={EVERY}, world=1)",
            "--callback", f"tests.ray.hooks:HoldAtCheckpoint(step={2 * EVERY}, world=2)"]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(main, argv)
        wait_for(lambda: (held / "step10_world1_rank0").exists() or future.done(), 240, "1 worker at step 10")
        assert not future.done(), future.result()
        node = cluster.add_node(num_cpus=1)  # room for a second worker: the run grows
        wait_for(lambda: len(list(held.glob("step20_world2_*"))) == 2 or future.done(), 240, "2 workers at step 20")
        assert not future.done(), future.result()
        cluster.remove_node(node)  # a worker's node is gone: the run shrinks
        assert future.result(timeout=300) == 0

    events = read_metrics(run_dir / "metrics.jsonl", "event")
    resizes = [(e["step"], e["old_world_size"], e["new_world_size"]) for e in events if e["event"] == "resize"]
    assert resizes == [(EVERY, 1, 2), (2 * EVERY, 2, 1)]
    worlds = [r["world_size"] for r in read_metrics(run_dir / "metrics.jsonl", "train")]
    assert worlds == [1] * EVERY + [2] * EVERY + [1] * EVERY
    assert_each_sample_once(run_dir, corpus_dir, STEPS, BATCH)

    # The same run at a fixed size (1 process, no Ray, unsharded) gives the same losses within LOSS_RTOL.
    fixed_cfg = load_config(run, [f"run_dir={tmp_path / 'fixed'}", "parallel.engine=none"])
    fixed = run_local(fixed_cfg, progress=False)
    assert _losses(run_dir) == pytest.approx(_losses(tmp_path / "fixed"), rel=LOSS_RTOL)
    elastic_val = read_metrics(run_dir / "metrics.jsonl", "eval")[-1]["val_loss"]
    assert elastic_val == pytest.approx(fixed.val_loss, rel=LOSS_RTOL)
