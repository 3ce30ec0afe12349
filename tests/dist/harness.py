"""Run a function on N CPU processes joined in a gloo process group (PyTorch's MultiProcessTestCase
pattern, small): each rank's return value comes back to the test, and every group is torn down."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainers.parallel.distributed import leave_groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # N processes share 2 cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent test
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        leave_groups()  # as trainers/launch.py: a group left to interpreter exit can abort the rank there
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    # The process then exits as any does: an abort at interpreter exit fails the test (mp.spawn raises).


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` on `world` spawned processes; returns the per-rank results in rank order.
    `fn` must be a module-level function (it is pickled into the children)."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(fn, world, free_port(), out, args), nprocs=world, join=True)
        results = []
        for rank in range(world):
            status, value = pickle.loads((Path(out) / f"rank{rank}.pkl").read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} failed: {value}")
            results.append(value)
        return results
