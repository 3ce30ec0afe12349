"""A placement group whose creator actor was killed (as a Train controller killed while starting its workers)
stays reserved while the driver's job lives; `release_stranded_placement_groups` frees those created since
its snapshot, and leaves older ones alone."""

from __future__ import annotations

import os

import pytest

from raytrain_ext.cleanup import placement_groups_of_this_job, release_stranded_placement_groups
from tests.ray.conftest import ray_local  # noqa: F401 - the module's Ray

pytestmark = pytest.mark.ray


def _state(pg_hex: str) -> str:
    from ray.util.placement_group import placement_group_table

    return placement_group_table()[pg_hex]["state"]


def test_placement_group_of_a_killed_creator_is_released(ray_local):  # noqa: F811
    ray = ray_local
    from ray.util.placement_group import placement_group, remove_placement_group

    @ray.remote(num_cpus=0, max_restarts=0)
    class Creator:
        def make(self) -> str:
            pg = placement_group([{"CPU": 1}])
            ray.get(pg.ready())
            return pg.id.hex()

        def die(self) -> None:  # as a killed controller: no cleanup of any kind
            os._exit(1)

    older = placement_group([{"CPU": 1}])  # the driver's own, from before the snapshot
    ray.get(older.ready())
    try:
        before = placement_groups_of_this_job()
        assert older.id.hex() in before
        creator = Creator.remote()
        stranded = ray.get(creator.make.remote())
        with pytest.raises(ray.exceptions.RayActorError):  # returns once Ray knows the creator is dead
            ray.get(creator.die.remote())
        assert _state(stranded) == "CREATED", "Ray keeps it: the creator's job (this driver) lives"

        assert release_stranded_placement_groups(before) == [stranded]
        assert _state(stranded) == "REMOVED"
        assert _state(older.id.hex()) == "CREATED"
        assert release_stranded_placement_groups(before) == [], "nothing left to remove"
    finally:
        remove_placement_group(older)
