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

__all__ = ["placement_groups_of_this_job", "release_stranded_placement_groups"]

_HELD = ("PENDING", "PREPARED", "CREATED", "RESCHEDULING")


def placement_groups_of_this_job() -> set[str]:
    """Ids (hex) of the placement groups that this driver's job created and that are not removed."""
    job = ray.get_runtime_context().get_job_id()  # a placement group id ends with its creator's job id
    return {pg for pg, info in placement_group_table().items() if pg.endswith(job) and info["state"] in _HELD}


def _alive_train_controllers() -> int | None:
    """Train controllers of this job still alive; None where the State API (the dashboard) is not served."""
    try:
        from ray.util.state import list_actors

        context = ray.get_runtime_context()
        filters = [("class_name", "=", "TrainController"), ("state", "=", "ALIVE"), ("job_id", "=", context.get_job_id())]
        # this driver's Ray by its address: another Ray on the machine would make the lookup ambiguous
        return len(list_actors(address=context.gcs_address, filters=filters, raise_on_missing_output=False))
    except Exception:  # noqa: BLE001 - no State API: one sweep is all we can do
        return None


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
