"""`trainers.fault_tolerance.silent_groups` reads torchft's lighthouse as it runs (its status page is the only
place it says whom it stopped hearing from): a real lighthouse, a quorum of two replicas, one of which stops
heartbeating."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from trainers.fault_tolerance import LIGHTHOUSE, silent_groups

torchft = pytest.importorskip("torchft")


def test_a_quorum_member_that_stops_heartbeating_is_named_and_the_others_are_not():
    from torchft.coordination import LighthouseClient, LighthouseServer

    server = LighthouseServer(bind="[::]:0", **{**LIGHTHOUSE, "min_replicas": 2})  # one quorum of both
    try:
        address = server.address()
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        quorums = []

        def join(replica: str) -> None:
            quorums.append(client.quorum(replica, timedelta(seconds=10), address="a", store_address="s", step=1,
                                         world_size=1, shrink_only=False))

        joins = [threading.Thread(target=join, args=(f"raytrain_{i}",)) for i in (0, 1)]
        for t in joins:
            t.start()
        for t in joins:
            t.join()
        assert len(quorums) == 2 and len(quorums[-1].participants) == 2, "both in one quorum"
        assert silent_groups(address) == []

        # raytrain_1 falls silent (the scenario's length: past the lighthouse's heartbeat timeout)
        limit = LIGHTHOUSE["heartbeat_timeout_ms"] / 1000
        until = time.monotonic() + limit + 0.5
        while time.monotonic() < until:
            client.heartbeat("raytrain_0")
            assert silent_groups(address) in ([], ["raytrain_1"])
            time.sleep(0.1)
        assert silent_groups(address) == ["raytrain_1"]
    finally:
        server.shutdown()


def test_a_lighthouse_that_does_not_answer_says_nothing():
    assert silent_groups("http://127.0.0.1:9", timeout_s=0.5) is None
    assert silent_groups("") is None  # a worker not started by Ray's torchft backend
