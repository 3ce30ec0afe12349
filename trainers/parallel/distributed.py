"""Process-group set-up from the environment torchrun (or Ray Train) provides."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from trainers._base import free_port, scoped_environ

__all__ = ["device_for_rank", "group_of_one", "init_from_env", "launched", "leave_groups"]


def launched() -> bool:
    """Whether a launcher started this process as a rank of a group: WORLD_SIZE > 1, or torchrun's
    rendezvous (WORLD_SIZE, MASTER_ADDR, MASTER_PORT) at any size, 1 included."""
    env = os.environ
    if int(env.get("WORLD_SIZE", "1")) > 1:
        return True
    return all(k in env for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(timeout_s: float = 600) -> bool:
    """Initialise the default process group when a launcher (torchrun, Ray Train) started this process as a
    rank (`launched`) and none exists yet: `torchrun --nproc-per-node 1` joins a group of one, so that every
    engine (ddp, fsdp) runs on one GPU as on many. gloo on CPU, nccl on GPU. Returns whether a group is
    initialised."""
    if dist.is_initialized():
        return True
    if not launched():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def leave_groups() -> None:
    """Destroy every process group while the interpreter is whole. The garbage that still holds them (a
    finished trainer's model, FSDP state and device mesh: reference cycles) is collected first, so that each
    gloo group's C++ object goes now, joining its worker threads. Left to interpreter exit, a worker thread
    still dropping a finished collective's tensors needs the GIL during finalization, and the process aborts
    after its work is done ("terminate called without an active exception"; pytorch/pytorch#190489): a
    torchrun rank that exits 134 fails the job."""
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def device_for_rank() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@contextlib.contextmanager
def group_of_one() -> Iterator[None]:
    """torchrun's environment for this one process (a free port on loopback) and the group `init_from_env`
    joins from it; both undone after (a benchmark row or a test runs an engine that needs a group)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    with scoped_environ(**env):
        try:
            if not init_from_env():
                raise RuntimeError("no process group was made from torchrun's environment")
            yield
        finally:
            if dist.is_initialized():
                leave_groups()
