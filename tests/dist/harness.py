"""Run a function on N CPU processes joined in a gloo process group (PyTorch's MultiProcessTestCase
pattern, small): each rank's return value comes back to the test, and every group is torn down.

A rank killed by a signal before it returned (a native crash inside torch: one default-tier run in CI
aborted a 4-rank tensor-parallel run mid-step with glibc's "malloc(): unaligned tcache chunk detected",
not reproduced in 57 runs of the same group here) raises `RankCrashed`, and faulthandler prints every
thread's Python stack to the test's captured stderr first. pytest reruns a test once for that error alone
(pytest-rerunfailures: pyproject's `reruns`/`only_rerun`), from fresh fixtures; a test crashed twice fails.
A rank that aborts after its result is written (interpreter teardown, which `leave_groups` makes safe) is
never rerun.

Ranks are forked from a forkserver that imported torch and the trainer once per pytest process, not spawned
as new interpreters: a spawned rank imports torch and the trainer again (~3-7 s each, 4 ranks on 2 cores:
13.6 s for a 4-rank all-reduce against 0.16 s forked, measured 2026-11-29 beside a loaded core). What a
spawned rank got from its parent at start it gets passed: the test's environment of the moment (the server's
is the one it started with), and its output, which goes to a file per rank and then to the test's own stderr
(the server's descriptors are those of the test that started it).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import pickle
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainers.parallel.distributed import leave_groups

RANK_THREADS = 1  # N processes share 2 cores


@contextlib.contextmanager
def rank_threads() -> Iterator[None]:
    """Torch computes with a rank's thread count meanwhile, for a reference run in the test's own process:
    MKL splits a matmul's rows over its threads, and a row's result can depend on the split (expert matmuls
    over the rows routed to each expert: 83 of 200 random splits of 128 rows differ in some row between 1 and
    2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: every socket stays bound until all are taken (ports picked one at a time can
    repeat: the kernel may hand a just-closed port out again, and Ray refuses two components on one port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


# Imported once, in the forkserver; a module that fails to import is skipped there (multiprocessing's rule) and
# imported by the rank that needs it.
_PRELOAD = ["torch", "torch.distributed", "pytest", "trainers.trainer", "tests.dist.harness"]
mp.set_forkserver_preload(_PRELOAD)


def _entry(rank: int, fn: Callable, world: int, port: int, out: str, env: dict[str, str], args: tuple) -> None:
    log = os.open(Path(out) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    faulthandler.enable(all_threads=True)  # a native crash prints where each thread was
    torch.set_num_threads(RANK_THREADS)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent test
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        leave_groups()  # as trainers/launch.py: a group left to interpreter exit can abort the rank there
    with open(Path(out) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    # A forked process ends in os._exit (multiprocessing's rule for a forked child): run the exit handlers an
    # interpreter's exit would (those of every module imported, the server's included), so that an abort there
    # still fails the test (start_processes raises), as it would at a spawned rank's or torchrun's exit.
    atexit._run_exitfuncs()


class RankCrashed(mp.ProcessExitedException):
    """A rank was killed by a signal before it wrote its result (the test's work did not finish). Still the
    ProcessExitedException it is: a test that kills a rank on purpose catches it, and is not rerun."""


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """`fn(rank, world, *args)` on `world` spawned processes; returns the per-rank results in rank order.
    `fn` must be a module-level function (it is pickled into the children)."""
    with tempfile.TemporaryDirectory() as out:
        try:
            try:
                mp.start_processes(_entry, args=(fn, world, free_port(), out, dict(os.environ), args), nprocs=world,
                                   join=True, start_method="forkserver")
            finally:
                _replay_logs(Path(out), world)
        except mp.ProcessExitedException as e:
            if e.signal_name is None or (Path(out) / f"rank{e.error_index}.pkl").exists():
                raise  # an exit code, or an abort after the work was done: a failure of its own
            msg = (f"rank {e.error_index} of {world} was killed by {e.signal_name} before it returned "
                   f"(its stderr above holds each thread's stack)")
            raise RankCrashed(msg, e.error_index, e.error_pid, e.exit_code, e.signal_name) from e
        results = []
        for rank in range(world):
            status, value = pickle.loads((Path(out) / f"rank{rank}.pkl").read_bytes())
            if status == "error":
                raise AssertionError(f"rank {rank} failed: {value}")
            results.append(value)
        return results


def _replay_logs(out: Path, world: int) -> None:
    """Each rank's output, in rank order, on this process's stderr (the test's, where pytest captures it)."""
    for rank in range(world):
        log = out / f"rank{rank}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if text:
            sys.stderr.write(f"--- rank {rank} of {world} ---\n{text}")
    sys.stderr.flush()
