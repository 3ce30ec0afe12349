"""Placement groups that Ray Train runs leave behind when their controller is killed while starting workers.

Ray frees a placement group once both its creator actor and its creator's job are dead; a Train run's
controller is killed with its owner (a Tune trial actor stopped by force, e.g. on Ctrl-C), but the job (this
driver) lives on. Ray Train 2.60 has a detached `PlacementGroupCleaner` for that case, but a worker group's
placement group is handed to it only after the group has started (`after_worker_group_start`): a
controller killed in between leaves its workers' CPUs reserved until this driver exits, and any later run
in the same driver (a resumed experiment, a notebook's next cell) waits for them forever.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

from raytrain_ext import ray_compat

__all__ = [
    "abort_train_controllers",
    "end_train_runs",
    "placement_groups_created_by",
    "placement_groups_of_this_job",
    "release_stranded_placement_groups",
    "train_controllers_of_this_job",
]

_HELD = ("PENDING", "PREPARED", "CREATED", "RESCHEDULING")


def placement_groups_of_this_job() -> set[str]:
    """Ids (hex) of the placement groups that this driver's job created and that are not removed."""
    job = ray.get_runtime_context().get_job_id()  # a placement group id ends with its creator's job id
    return {pg for pg, info in placement_group_table().items() if pg.endswith(job) and info["state"] in _HELD}


def train_controllers_of_this_job(own: bool = False) -> set[str]:
    """Ids (hex) of this job's Ray Train controller actors not yet dead (being created, alive or
    restarting), from the GCS's actor table (no State API or dashboard needed). `own`: only those this
    process created (a Tune trial's, not its sibling trials')."""
    table = ray_compat.actors_of_this_job()
    me = ray_compat.own_worker_address() if own else None
    return {
        aid
        for aid, info in table.items()
        if info["ActorClassName"] == "TrainController"
        and info["State"] != "DEAD"
        and (me is None or (info["OwnerAddress"]["IPAddress"], info["OwnerAddress"]["Port"]) == me)
    }


def abort_train_controllers(ids: Iterable[str], timeout_s: float = 10.0) -> None:
    """Abort these Train controllers as Ray's own Ctrl-C handler does (`controller.abort`: its workers are
    stopped and the actor exits), so that a `fit()` waiting on one returns before Ray shuts down. One that
    does not answer within `timeout_s` is killed: a controller placing workers blocks its event loop for up
    to RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s), and one still being created cannot answer at all;
    `end_train_runs` also frees what it had reserved."""
    handles = [ray_compat.actor_handle(aid) for aid in ids]
    pending = {h.abort.remote(): h for h in handles}
    done, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            pass  # abort ends with the actor's exit
    for ref in late:
        ray.kill(pending[ref], no_restart=True)


def placement_groups_created_by(actor_ids: Iterable[str]) -> set[str]:
    """Ids (hex) of the placement groups not removed whose creator is one of these actors."""
    from ray.core.generated.gcs_pb2 import PlacementGroupTableData

    actor_ids = set(actor_ids)
    return {
        info.placement_group_id.hex()
        for info in ray_compat.placement_group_records()
        if info.creator_actor_id.hex() in actor_ids and info.state != PlacementGroupTableData.REMOVED
    }


def end_train_runs(controller_ids: Iterable[str], timeout_s: float = 10.0) -> None:
    """End the Train runs of these controllers: abort them (see `abort_train_controllers`) and remove the
    placement groups they created, which a controller killed while placing workers leaves reserved."""
    controller_ids = set(controller_ids)
    abort_train_controllers(controller_ids, timeout_s)
    for pg in placement_groups_created_by(controller_ids):
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg))))


def _alive_train_controllers() -> int:
    return len(train_controllers_of_this_job())


def release_stranded_placement_groups(before: Iterable[str], timeout_s: float = 30.0) -> list[str]:
    """Remove this job's placement groups created since `before` (a `placement_groups_of_this_job()` taken
    when the runs started), once none of them can be in use: call it after every Train run the driver
    started has ended. Waits (up to `timeout_s`) for controllers still being torn down, which may create
    one more. Returns the ids removed."""
    before, removed = set(before), []
    deadline = time.monotonic() + timeout_s
    while True:
        alive = _alive_train_controllers()
        for pg in sorted(placement_groups_of_this_job() - before - set(removed)):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg))))
            removed.append(pg)
        if not alive or time.monotonic() > deadline:
            return removed
        time.sleep(0.5)  # polling the controllers' teardown, which Ray gives no event for
