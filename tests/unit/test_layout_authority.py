"""One layout authority (`trainers.layout`): a bad layout gets the same one line from `raytrain plan`,
`raytrain train` (refused before Ray starts), `raytrain cluster check` and the workers themselves
(`python -m trainers train` under torchrun's environment, N processes: every rank exits 2, the node's
local rank 0 says the line once and the others say nothing, so the terminal they share shows it once).

The expected line is the authority's own ConfigError text: `ParallelLayout.of` for a world size, or the
config's validation for the rules that need none. Each command adds only its prefix: `raytrain: error: `,
`error: ` (python -m trainers) or `[NO] layout: ` (cluster check, whose other checks still report).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

import trainers.launch
from raytrain_ext import launcher  # imports Ray, which sets RAY_CLIENT_MODE: at collection, not in a test
from raytrain_ext.cli import main
from tests.conftest import tiny_raw
from tests.dist.harness import free_port
from trainers._base import ConfigError
from trainers.config import parse_config
from trainers.layout import ParallelLayout

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "clusters" / "aws-gpu.yaml"  # 8- and 4-GPU node types: every world size here fits a node

# name -> (sections over tests.conftest.tiny_raw (dim 32, 2 heads, 2 blocks, global batch 8 of micro 4),
#          world size, what the line must name)
CASES: dict[str, tuple[dict[str, Any], int, str]] = {
    "tp-does-not-divide-the-world": ({"parallel": {"engine": "fsdp", "tp": 2}}, 3, "parallel.tp=2"),
    "pp-does-not-divide-the-world": ({"parallel": {"engine": "fsdp", "pp": 2}}, 3, "parallel.pp=2"),
    "ep-does-not-divide-dp": (
        {"model": {"moe": {"num_experts": 6, "top_k": 2}}, "parallel": {"engine": "fsdp", "ep": 3},
         "train": {"global_batch_size": 16}},
        4,
        "parallel.ep=3",
    ),
    "tp-does-not-divide-the-heads": (  # a config rule: refused on load, at any world size
        {"model": {"n_heads": 4}, "parallel": {"engine": "fsdp", "tp": 3}}, 3, "parallel.tp=3"),
    "microbatches-do-not-divide": (
        {"parallel": {"engine": "fsdp", "pp": 2, "n_microbatches": 3}}, 2, "parallel.n_microbatches=3"),
}
# The one case spawning processes in the default tier (3 torch processes: ~15 s on 2 busy cores) is a
# world-size rule, which every rank checks before it joins the process group (`trainers.launch`); the
# others are slow-tier.
FAST_TORCHRUN = "tp-does-not-divide-the-world"


def _expected(raw: dict[str, Any], world: int) -> str:
    """The authority's line: the config's validation, else the layout at `world`."""
    with pytest.raises(ConfigError) as e:
        ParallelLayout.of(parse_config(raw), world)
    return str(e.value)


def _write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _one(lines: list[str], prefix: str) -> str:
    """The single line starting with `prefix`, without it."""
    found = [line[len(prefix):] for line in lines if line.startswith(prefix)]
    assert len(found) == 1, lines
    return found[0]


def _refuse(what: str):
    def called(*args, **kwargs):
        raise AssertionError(f"{what} started although the layout is bad")

    return called


@pytest.fixture
def case(request, corpus_dir, tmp_path):
    sections, world, names = CASES[request.param]
    raw = tiny_raw(corpus_dir, tmp_path / "run", **sections)
    return raw, world, names, _expected(raw, world), _write(tmp_path, raw)


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_plan_train_and_cluster_check_give_the_authoritys_line(case, monkeypatch, capsys):
    raw, world, names, expected, path = case
    assert names in expected and "fix:" in expected and "\n" not in expected

    # raytrain plan --world-size N
    assert main(["plan", str(path), "--world-size", str(world)]) == 2
    out = capsys.readouterr()
    assert _one(out.err.splitlines(), "raytrain: error: ") == expected and "verdict" not in out.out

    # raytrain train with N workers: refused before Ray (or a local run) starts
    monkeypatch.setattr(launcher, "ensure_ray", _refuse("Ray"))
    monkeypatch.setattr(trainers.launch, "run_local", _refuse("the local run"))
    assert main(["train", str(path), "--no-progress", "--set", f"scaling.num_workers={world}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and _one(err, "raytrain: error: ") == expected
    assert not Path(raw["run_dir"]).exists()

    # raytrain cluster check --run: the layout check's line (or the config's own refusal on load)
    code = main(["cluster", "check", str(CLUSTER), "--run", str(path), "--set", f"scaling.num_workers={world}",
                 "--set", "scaling.use_gpu=true"])
    out = capsys.readouterr()
    if code == 2:  # a rule without a world size: the run YAML does not load
        assert _one(out.err.splitlines(), "raytrain: error: ") == expected
    else:
        assert code == 1 and "does NOT fit" in out.out
        assert _one([line.strip() for line in out.out.splitlines()], "[NO] layout: ") == expected


def _workers(path: Path, world: int) -> list[subprocess.CompletedProcess]:
    """`python -m trainers train` as `torchrun --nproc-per-node world` starts it: each rank with RANK,
    WORLD_SIZE, ... in its environment, joining one gloo group, and an error file of its own
    (TORCHELASTIC_ERROR_FILE: `path`'s folder / error-RANK.json) for torchrun's failure summary."""
    port, procs = free_port(), []
    base = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    for rank in range(world):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "TORCHELASTIC_ERROR_FILE": str(path.parent / f"error-{rank}.json")}
        procs.append(subprocess.Popen([sys.executable, "-m", "trainers", "train", str(path), "--no-progress"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=() if name == FAST_TORCHRUN else pytest.mark.slow) for name in CASES],
    indirect=True,
)
def test_torchrun_workers_give_the_authoritys_line(case):
    raw, world, names, expected, path = case
    for rank, proc in enumerate(_workers(path, world)):
        assert proc.returncode == 2, (rank, proc.stderr[-2000:])
        if rank == 0:
            assert _one(proc.stderr.splitlines(), "error: ") == expected, proc.stderr[-2000:]
        else:
            assert "error" not in proc.stderr, (rank, proc.stderr[-2000:])
        # torchrun's summary of this rank (its own reader of the file) shows the line, not a pointer to docs
        failure = ProcessFailure(rank, 0, proc.returncode, str(path.parent / f"error-{rank}.json"))
        assert failure.message["extraInfo"]["py_callstack"] == f"error: {expected}"
        assert not list(Path(raw["run_dir"]).glob("checkpoints/*"))
