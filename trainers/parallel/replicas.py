"""The engine of a per-step fault-tolerant run (`scaling.fault_tolerance: per_step`, rules and semantics in
`trainers.fault_tolerance`): this process is one torchft replica group holding the whole model; torchft's
`Manager` forms a quorum of the live groups at every step, heals a group that is behind from a live one's
memory, averages the gradients over the quorum, and says whether the step commits.

The Trainer drives it through three hooks the other engines leave as no-ops: `join` (the first quorum, before
any checkpoint is read: a replacement heals here), `begin_step` (the step's quorum: this group's rank and the
number of live groups, which shard the step's samples) and `should_commit` (after the gradients are averaged:
False, and the step is trained again by the next quorum).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp

from trainers.fault_tolerance import HOST_ENV, TIMEOUT_S, replica_group
from trainers.layout import ParallelLayout
from trainers.parallel.engine import Batch, Engine

__all__ = ["ReplicaGroupEngine"]

# Steps in a row that do not commit before the run fails (a quorum that cannot hold together).
MAX_UNCOMMITTED = 20
StateFns = tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]


class ReplicaGroupEngine(Engine):
    """The whole model in this process; the data-parallel ranks are the live replica groups of each step."""

    name = "ddp"

    def __init__(self, layout: ParallelLayout, device: torch.device):
        super().__init__(device, layout)
        self.group = replica_group()
        self.dp_rank, self.dp_size = 0, 1  # this step's: set by each quorum
        self.manager: Any = None
        self._pg: Any = None  # torchft's reconfigurable process group (the manager configures it at each quorum)
        self._main = False
        self._loss: torch.Tensor | None = None
        self._quorum_ahead = False
        self.healed_from: dict[str, Any] | None = None  # the last heal: from which group, at which step, how long
        self._heal: dict[str, Any] | None = None  # a heal in a step's quorum, not yet taken (`take_heal`)

    @property
    def world_size(self) -> int:  # the live workers: one per live group
        return self.dp_size

    @property
    def replicas(self) -> int:
        return self.dp_size

    @property
    def is_main(self) -> bool:
        """The live group of the lowest index writes the run's records (set at each quorum)."""
        return self._main

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
        if self.device.type == "cuda":
            from torchft import ProcessGroupNCCL

            pg: Any = ProcessGroupNCCL(timeout=timeout)
        else:
            pg = ProcessGroupGloo(timeout=timeout)
        self._pg = pg
        get_trainer, set_trainer = trainer_state

        def state_dict() -> dict[str, Any]:  # a live group's, sent to one that heals
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "precision": self.precision.state_dict(), "trainer": get_trainer(), "group": self.group}

        def load_state_dict(state: dict[str, Any]) -> None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
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
            rank=0,
            world_size=1,
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
        self.dp_rank, self.dp_size = (rank if rank is not None else 0), self.manager.num_participants()
        self._main = rank == 0
        if self.healed_from is not before:  # behind the others (a new group, a straggler, one cut off and back)
            self.healed_from.update(step=self.manager.current_step(), heal_s=round(time.perf_counter() - start, 4))
            self._heal = self.healed_from

    def take_heal(self) -> dict[str, Any] | None:
        heal, self._heal = self._heal, None
        return heal

    def should_commit(self) -> bool:
        return self.manager.should_commit()

    # -------------------------------------------------------------------------------------------- step

    def forward_backward(self, batches: Iterable[Batch], count: int) -> torch.Tensor:
        """This group's share of the step, then one averaging over the quorum of its gradients and loss
        (one flat buffer: one collective a step)."""
        loss = super().forward_backward(batches, count)
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss.reshape(1).to(grads[0].dtype)])
        # The sum over the quorum, then the mean. On a peer's error torchft returns at once and the step's
        # commit vote fails: the buffer is then never used.
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        if self.manager.errored() is not None:
            # A peer was lost inside the collective: close this group's side now, not at the next quorum's
            # reconfigure. In a ring a live peer can be waiting on this group's connection rather than the lost
            # one's; it holds until that connection closes, and the lighthouse forms no quorum without it
            # (more than half of the heartbeating groups must join): 7.5-9.4 s after a kill, until Ray's
            # replacement joined instead (bench/ft.py, torchft's lighthouse log).
            self._pg.abort()
        flat /= self.dp_size
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(g)
            offset += n
        self._loss = flat[-1].detach()
        return loss

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The step's loss averaged with the gradients; an evaluation (every group evaluates the whole
        validation set, `eval_shard`) is this group's own."""
        if self._loss is not None:
            value, self._loss = self._loss, None
        return value

    def eval_shard(self) -> tuple[int, int]:
        return 0, 1  # no collective outside the quorum's: a group lost in an evaluation holds nobody up

    def close(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
