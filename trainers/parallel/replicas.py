"""The engines of a per-step fault-tolerant run (`scaling.fault_tolerance: per_step`, rules and semantics in
`trainers.fault_tolerance`): this process is one worker of a torchft replica group, which holds the whole model
in one worker (`ReplicaGroupEngine`) or shards it over its workers with FSDP2 (`ReplicaGroupFSDPEngine`, the
group's own process group, as a run of that many workers would); torchft's `Manager` forms a quorum of the live
groups at every step, heals a group that is behind from a live one's memory (each worker from the worker of the
same rank in that group: the same shard), averages the gradients over the quorum, and says whether the step
commits.

The Trainer drives it through three hooks the other engines leave as no-ops: `join` (the first quorum, before
any checkpoint is read: a replacement heals here), `begin_step` (the step's quorum: this group's rank and the
number of live groups, which shard the step's samples) and `should_commit` (after the gradients are averaged:
False, and the step is trained again by the next quorum).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import AllreduceOptions, ReduceOp
from torch.distributed.tensor import DTensor

from trainers.fault_tolerance import HOST_ENV, LIGHTHOUSE_ENV, TIMEOUT_S, replica_group, silent_groups
from trainers.layout import ParallelLayout
from trainers.parallel.engine import Batch, Engine
from trainers.parallel.native import FSDPEngine

__all__ = ["ReplicaGroupEngine", "ReplicaGroupFSDPEngine", "ReplicaGroups"]

# Steps in a row that do not commit before the run fails (a quorum that cannot hold together).
MAX_UNCOMMITTED = 20
# A step's all-reduce not done after this long asks the lighthouse, and again as often, whether a group of its
# quorum stopped heartbeating (a host cut off: no socket closes); an all-reduce on CPU takes milliseconds here.
SILENCE_CHECK_S = 0.25
StateFns = tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]


class ReplicaGroups:
    """Before an engine's class: its data-parallel ranks are the workers of each step's live replica groups
    (group by group), and the gradients it leaves (averaged over the group's workers, by FSDP where it shards)
    are averaged over the groups by torchft. `layout` is the group's own process group."""

    def __init__(self, layout: ParallelLayout, device: torch.device, allreduce_timeout_s: float = TIMEOUT_S):
        super().__init__(device=device, layout=layout)
        self.group = replica_group()
        self.allreduce_timeout_s = allreduce_timeout_s
        self.group_rank, self.group_workers = layout.dp_rank, layout.dp  # in the group (FSDP's shards)
        self.groups = 1  # live groups of this step: set by each quorum
        # this step's (the live workers of its quorum): set by each quorum
        self.dp_rank, self.dp_size, self.world_size = self.group_rank, self.group_workers, self.group_workers
        self.manager: Any = None
        self._pg: Any = None  # torchft's reconfigurable process group (the manager configures it at each quorum)
        self._main = False
        self._loss: torch.Tensor | None = None
        self._quorum_ahead = False
        self.healed_from: dict[str, Any] | None = None  # the last heal: from which group, at which step, how long
        self._heal: dict[str, Any] | None = None  # a heal in a step's quorum, not yet taken (`take_heal`)
        self._aside: list[tuple[Any, Any]] = []  # (process group, its collective): set aside on a silent peer

    @property
    def replicas(self) -> int:
        return self.groups

    @property
    def is_main(self) -> bool:
        """The first worker of the live group of the lowest index writes the run's records (set at each quorum)."""
        return self._main and self.group_rank == 0

    @property
    def saves(self) -> bool:
        return self._main

    # ------------------------------------------------------------------------------------------ quorum

    def join(self, trainer_state: StateFns) -> bool:
        """The first quorum of this group, with the trainer's state functions (step, RNG, ...) beside the
        model's and the optimizer's. True when it healed from a live group (its state is then theirs and no
        checkpoint is to be read); False when no live group is ahead (the run starts or resumes from disk)."""
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        # torchft logs every quorum and commit, and a lost peer as a traceback in every live group: the run's
        # own events say it once (metrics.jsonl's `replicas` and `healed`, told by the driver's console).
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", module=r"torchft\.")  # its transport's, on torch's newer APIs
        timeout = timedelta(seconds=TIMEOUT_S)
        # The groups' process group, whose default timeout ends a step's all-reduce that waits on a slow peer
        # after `allreduce_timeout_s` (one fallen silent, a host cut off, sooner on CPU: `_sum_over_groups`).
        pg_timeout = timedelta(seconds=self.allreduce_timeout_s)
        if self.device.type == "cuda":
            from torchft import ProcessGroupNCCL

            pg: Any = ProcessGroupNCCL(timeout=pg_timeout)
        else:
            pg = ProcessGroupGloo(timeout=pg_timeout)
        self._pg = pg
        get_trainer, set_trainer = trainer_state

        def state_dict() -> dict[str, Any]:  # a live group's worker's, sent to the same rank of one that heals
            return {"model": {k: local(v) for k, v in self.model.state_dict().items()},
                    "optimizer": local_optimizer_state(self.optimizer.state_dict()),
                    "precision": self.precision.state_dict(), "trainer": get_trainer(), "group": self.group}

        def load_state_dict(state: dict[str, Any]) -> None:
            with torch.no_grad():
                for k, v in self.model.state_dict().items():  # this worker's tensors (its shards), in place
                    local(v).copy_(state["model"][k])
            self.optimizer.load_state_dict(sharded_optimizer_state(self.optimizer, state["optimizer"]))
            self.precision.load_state_dict(state["precision"])
            set_trainer(state["trainer"])
            self.healed_from = {"group": self.group, "from_group": state["group"]}

        self.manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=1,
            use_async_quorum=False,  # the quorum (and a heal) completes before the step reads its samples
            init_sync=False,  # every group builds the same weights from the run's seed
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=self.group_rank,  # the group's workers: its first serves the others' manager
            world_size=self.group_workers,
            replica_id=f"raytrain_{self.group}",
            hostname=os.environ.get(HOST_ENV) or socket.gethostname(),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=self.device),
            max_retries=MAX_UNCOMMITTED,
        )
        self.begin_step()
        # This quorum is the first step's: the groups in it train that step together next (a second quorum
        # here would wait for groups that are inside the step, waiting for this one).
        self._quorum_ahead = True
        self._heal = None  # told by this return, not by `take_heal`
        return self.healed_from is not None

    def committed_step(self, step: int) -> None:
        """The step this group restored from disk (the quorum's step from now on)."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self) -> None:
        """This step's quorum (a group behind heals in it): this group's rank among the live groups and
        their number, which split the step's samples."""
        if self._quorum_ahead:  # the one `join` formed
            self._quorum_ahead = False
            return
        start, before = time.perf_counter(), self.healed_from
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        self.groups = self.manager.num_participants()
        self.dp_rank = (rank if rank is not None else 0) * self.group_workers + self.group_rank
        self.dp_size = self.world_size = self.groups * self.group_workers
        self._main = rank == 0
        if self.healed_from is not before:  # behind the others (a new group, a straggler, one cut off and back)
            self.healed_from.update(step=self.manager.current_step(), heal_s=round(time.perf_counter() - start, 4))
            self._heal = self.healed_from

    def peers_silent(self) -> bool:
        """Whether the lighthouse stopped hearing from a group of the last quorum (a host lost or cut off)."""
        return bool(silent_groups(os.environ.get(LIGHTHOUSE_ENV, "")))

    def take_heal(self) -> dict[str, Any] | None:
        heal, self._heal = self._heal, None
        return heal

    def should_commit(self) -> bool:
        return self.manager.should_commit()

    # -------------------------------------------------------------------------------------------- step

    def forward_backward(self, batches: Iterable[Batch], count: int) -> torch.Tensor:
        """This worker's share of the step (its gradients averaged over the group's workers by the engine),
        then one averaging over the quorum of its gradients (its shards of them) and the group's loss (one flat
        buffer: one collective a step)."""
        loss = super().reduce_mean(super().forward_backward(batches, count))  # the group's mean
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1).to(grads[0].dtype)])
        # The sum over the quorum, then the mean. On a peer's error, or its silence, the step's commit vote
        # fails: the buffer is then never used.
        if not self._sum_over_groups(flat):
            flat = torch.zeros_like(flat)  # (the collective set aside still holds that one)
        elif self.manager.errored() is not None:
            # A peer was lost inside the collective: close this group's side now, not at the next quorum's
            # reconfigure. In a ring a live peer can be waiting on this group's connection rather than the lost
            # one's; it holds until that connection closes, and the lighthouse forms no quorum without it
            # (more than half of the heartbeating groups must join): 7.5-9.4 s after a kill, until Ray's
            # replacement joined instead (bench/ft.py, torchft's lighthouse log).
            self._pg.abort()
        flat /= self.groups
        offset = 0
        with torch.no_grad():
            for p, g in zip(params, grads):
                n = g.numel()
                mean = flat[offset:offset + n].view_as(g)
                if isinstance(p.grad, DTensor):
                    local(p.grad).copy_(mean)
                elif isinstance(p, DTensor):
                    p.grad = DTensor.from_local(mean, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                else:
                    p.grad = mean
                offset += n
        self._loss = flat[-1].detach()
        return loss

    def _sum_over_groups(self, flat: torch.Tensor) -> bool:
        """`flat` summed over the quorum, in place; a peer's error is the manager's (the step does not commit).
        On CPU, a peer the lighthouse stopped hearing from too, once it says so rather than after
        `allreduce_timeout_s` (gloo's collective cannot be ended sooner): its process group, the collective in
        flight, is set aside (ended by its timeout, in the background) and the next quorum makes a new one at
        once. False then. On CUDA, NCCL's wait holds the stream, not this thread: torchft's own, to its timeout."""
        manager = self.manager
        if self.device.type == "cuda" or manager.errored() is not None:
            manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()  # (a no-op once errored)
            return True
        from trainers.torch_compat import set_aside

        manager.wait_quorum()
        if not manager.is_participating():
            flat.zero_()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        future = self._pg.allreduce([flat], opts).get_future()
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        while not done.wait(SILENCE_CHECK_S):
            silent = silent_groups(os.environ.get(LIGHTHOUSE_ENV, ""))
            if silent:
                manager.report_error(TimeoutError(f"replica groups {silent} stopped heartbeating in a step"))
                self._aside = [(pg, f) for pg, f in self._aside if not f.done()] + [(set_aside(self._pg), future)]
                return False
        try:
            future.value()
        except Exception as e:  # noqa: BLE001 - a peer lost in the collective: this step is not committed
            manager.report_error(e)
        return True

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The step's loss averaged with the gradients; an evaluation (every group evaluates the whole
        validation set over its workers, `eval_shard`) is this group's own."""
        if self._loss is not None:
            value, self._loss = self._loss, None
            return value
        return super().reduce_mean(value)

    def eval_shard(self) -> tuple[int, int]:
        # no collective outside the group's and the quorum's: a group lost in an evaluation holds nobody up
        return self.group_rank, self.group_workers

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
        super().close()


class ReplicaGroupEngine(ReplicaGroups, Engine):
    """A replica group of one worker holding the whole model."""

    name = "ddp"


class ReplicaGroupFSDPEngine(ReplicaGroups, FSDPEngine):
    """A replica group of `scaling.workers_per_group` workers holding the model's FSDP2 shards (its optimizer
    state and gradients sharded with them); torchft averages each shard's gradients over the same worker of
    every live group."""

    name = "fsdp"


def local(value: Any) -> Any:
    """This worker's part of a tensor (a DTensor's local shard), or the value itself."""
    return value.to_local() if isinstance(value, DTensor) else value


def local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's `state_dict()` with this worker's shards of its tensors: the same rank of another group
    holds the same shards."""
    return {**state, "state": {i: {k: local(v) for k, v in s.items()} for i, s in state["state"].items()}}


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """`local_optimizer_state` of a peer as this optimizer loads it: each shard as its parameter's DTensor."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def shard(p: torch.Tensor, v: Any) -> Any:
        if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == local(p).shape:
            return DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        return v

    out = {i: {k: shard(params[int(i)], v) for k, v in s.items()} for i, s in state["state"].items()}
    return {**state, "state": out}
