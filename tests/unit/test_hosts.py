"""raytrain_ext.hosts and .network without a cluster: the lost-host line's cause from a real connect, the
watcher over a node table that changes, the interface of an address, and Ray's node-death messages kept off
the console (the cluster tier proves the same across test hosts)."""

from __future__ import annotations

import errno
import socket
import sys

from raytrain_ext.hosts import RAY_GONE, UNREACHABLE, HostWatcher, probe_cause
from raytrain_ext.network import interface_of
from raytrain_ext.worker_logs import WorkerLogs, lost_worker
from trainers.run_dir import WORKER_LOG


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_host_that_answers_without_ray_is_told_apart_from_one_that_does_not_answer(monkeypatch):
    assert probe_cause("127.0.0.1", _closed_port()) == RAY_GONE  # refused: the machine is there
    # No answer (a partition: the cluster tier cuts a real link); here the connect's outcomes, faked, since a
    # test on this machine sends nothing beyond loopback
    for error in (TimeoutError("timed out"), OSError(errno.EHOSTUNREACH, "No route to host"),
                  OSError(errno.ENETUNREACH, "Network is unreachable")):
        def refuse(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(socket, "create_connection", refuse)
        assert probe_cause("10.0.0.13", 40000) == UNREACHABLE


def _node(node_id: str, address: str, port: int, alive: bool = True, **extra) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "NodeManagerHostname": f"host-{node_id}",
            "NodeManagerPort": port, "Alive": alive, **extra}


def test_the_watcher_tells_each_lost_and_returning_host_once_and_refreshes_ray_s_view():
    port = _closed_port()
    table = [_node("a", "127.0.0.1", port), _node("b", "127.0.0.2", port)]
    said, refreshed = [], []
    watcher = HostWatcher(said.append, lambda host: "the run goes on", "it grows back", nodes=lambda: table)
    watcher.on_change = lambda: refreshed.append(True)
    watcher.alive = watcher._alive(table)
    assert not watcher.poll() and not said

    table = [table[0], _node("b", "127.0.0.2", port, alive=False, DeathReason=2)]
    assert watcher.poll()
    assert said == [f"raytrain: lost host host-b (127.0.0.2): {RAY_GONE}; the run goes on"]
    assert watcher.is_lost("127.0.0.2") and not watcher.is_lost("127.0.0.1")
    assert not watcher.poll() and len(said) == 1, "told once"

    table = [*table, _node("c", "127.0.0.2", port)]  # the host's Ray again: a new node id, the same address
    assert watcher.poll()
    assert said[1].startswith("raytrain: host host-b (127.0.0.2) is back in the cluster after") and "it grows back" in said[1]
    assert not watcher.is_lost("127.0.0.2") and refreshed == [True, True]


def test_a_node_stopped_on_purpose_is_said_so():
    table = [_node("a", "127.0.0.1", 1)]
    said = []
    watcher = HostWatcher(said.append, lambda host: "next", "back", nodes=lambda: table)
    watcher.on_change = lambda: None
    watcher.alive = watcher._alive(table)
    table = [_node("a", "127.0.0.1", 1, alive=False, DeathReason=1, DeathReasonMessage="received SIGTERM")]
    watcher.poll()
    assert said == ["raytrain: lost host host-a (127.0.0.1): its Ray was stopped (received SIGTERM); next"]


def test_the_interface_of_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("198.18.255.254") is None


def test_a_lost_hosts_messages_go_to_the_log(tmp_path, capsys):
    printed = []
    logs = WorkerLogs(tmp_path, out=sys.stderr)
    logs.printer = printed.append
    verdict = [
        "The node with node id: d1cb and address: 198.18.7.13 and node name: 198.18.7.13 has been marked dead "
        "because the detector has missed too many heartbeats from it. This can happen when a \t(1) raylet crashes",
        "\t(2) raylet has lagging heartbeats due to slow network or busy workload.",
    ]
    back = ["[2026-11-26 16:13:38,325 C 19 19] (raylet) node_manager.cc:519: GCS consider this node to be dead.",
            "*** StackTrace Information ***"]
    frames = ["/venv/ray/core/src/ray/raylet/raylet(+0xff770a) [0x55d90668b70a] ray::operator<<()", ""]
    logs.handle({"pid": "raylet", "is_err": False, "lines": verdict})
    logs.handle({"pid": "raylet", "ip": "198.18.7.13", "is_err": True, "lines": back})
    logs.handle({"pid": "raylet", "ip": "198.18.7.13", "is_err": True, "lines": frames})  # the trace goes on
    logs.handle({"actor_name": "RayTrainWorker", "pid": 5, "is_err": True,
                 "lines": ["[W1126 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved."]})
    logs.handle({"pid": "raylet", "is_err": False, "lines": ["something else"]})
    assert [d["lines"] for d in printed] == [["something else"]]
    assert capsys.readouterr().err == ""
    log = (tmp_path / WORKER_LOG).read_text()
    assert "marked dead" in log and "raylet(+0xff770a)" in log and "client socket" in log


def test_a_worker_that_died_with_its_node_is_left_to_the_host_line():
    text = ["ray.exceptions.ActorDiedError: The actor died because its node has died. Node Id: 3c16",
            "Worker PID: 17"]
    assert lost_worker(text, 20) is None
