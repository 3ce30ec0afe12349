"""`--profile STEP:COUNT` on 2 gloo processes: a Chrome trace per rank with our named ranges, the per-step
breakdown in metrics.jsonl, and the memory snapshot skipped in one line on CPU."""

from __future__ import annotations

import json

import pytest

from tests.conftest import tiny_raw
from tests.dist.harness import run_ranks
from trainers.config import parse_config
from trainers.metrics import read_metrics
from trainers.trainer import Trainer

pytestmark = pytest.mark.dist

RANGES = ("data", "forward", "backward", "optimizer", "communication")


def _train(rank: int, world: int, raw: dict) -> None:
    Trainer(parse_config(raw), progress=False).fit()


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_profile_writes_a_chrome_trace_per_rank(engine, corpus_dir, tmp_path, capfd):
    raw = tiny_raw(
        corpus_dir,
        tmp_path / "run",
        parallel={"engine": engine},
        train={"steps": 6, "eval_every": 6},
        checkpoint={"every": 6},
        profile={"start_step": 2, "steps": 2, "memory_snapshot": True},
    )
    run_ranks(_train, 2, raw)
    run_dir = tmp_path / "run"
    traces = sorted((run_dir / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["rank0-steps2-3.json", "rank1-steps2-3.json"]
    for trace in traces:
        events = json.loads(trace.read_text())["traceEvents"]  # Chrome trace JSON
        names = [e.get("name") for e in events if e.get("ph") == "X"]
        for name in RANGES:
            assert name in names, (trace.name, name)
        # two steps of one micro-batch per rank (global batch 8 = micro-batch 4 x 2 ranks)
        assert names.count("optimizer") == 2, trace.name
        assert names.count("forward") == names.count("backward") == 2, trace.name

    rows = read_metrics(run_dir / "metrics.jsonl")
    (event,) = [r for r in rows if r.get("event") == "profile"]
    assert event["step"] == 3 and event["trace"] == str(traces[0])
    assert event["memory_snapshot"] == "skipped: needs CUDA (device cpu)"
    err = capfd.readouterr().err
    assert err.count("no memory snapshot on cpu") == 1, "rank 0 says it once"
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 7)), "a breakdown row for every step"
    for r in train:
        assert r["data_s"] >= 0 and r["forward_backward_s"] > 0 and r["optimizer_s"] > 0
        assert r["data_s"] + r["forward_backward_s"] + r["optimizer_s"] <= r["step_time_s"]


def test_profile_window_must_fit_the_run(tiny_config):
    from trainers.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"profile.start_step=9 with profile.steps=3 ends past train.steps=10"
    ):
        tiny_config(train={"steps": 10}, profile={"start_step": 9, "steps": 3})
    with pytest.raises(ConfigError, match="profile.memory_snapshot=true needs profiled steps"):
        tiny_config(profile={"memory_snapshot": True})
