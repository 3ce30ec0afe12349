"""Cluster tier (`pytest -m cluster`, `make test-cluster`): test hosts built from network namespaces on this
machine (tests/cluster/netns.py), Ray across them with token auth, an S3-compatible server on a host of its
own (tests/cluster/scenarios.py). Root only: elsewhere the tier is skipped with one line.

One cluster serves the whole tier (bring-up ~20-80 s). Its teardown ends every process of every namespace it
made and deletes the namespaces, after success, failure, Ctrl-C or SIGTERM; its last check is that nothing
of it is left (a leftover fails the tier)."""

from __future__ import annotations

import atexit
import signal

import pytest

from tests.cluster.netns import can_make_hosts


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cluster/" in str(item.fspath):
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def tier():
    why = can_make_hosts()
    if why is not None:
        pytest.skip(f"cluster tier skipped: {why}")
    from tests.cluster.scenarios import bring_up

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    cluster = bring_up()
    atexit.register(cluster.hosts.down)  # a run ended before its teardown (idempotent)
    try:
        yield cluster
    finally:
        cluster.hosts.down()
        atexit.unregister(cluster.hosts.down)
        signal.signal(signal.SIGTERM, previous)
        left = cluster.hosts.leftovers()
        assert not left, f"the cluster tier left these behind: {left}"
