"""A lost Train worker on the console: the tracebacks Ray forwards go to the run's log, one line is printed
(raytrain_ext.worker_logs; the lines below are what Ray 2.60 forwarded when rank 1 of a 2-worker DDP run
was SIGKILLed at step 7, its newest checkpoint at step 5)."""

from __future__ import annotations

import sys

from raytrain_ext.worker_logs import WorkerLogs, lost_worker, split_tracebacks
from trainers.run_dir import WORKER_LOG

SURVIVOR = [
    "Error in training function:",
    '  File "/work/raytrain_ext/worker.py", line 162, in train_fn',
    "    run_local(cfg, callbacks=callbacks, progress=False, hold_lock=False)",
    "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:16789.",
]
CONTROLLER = [
    "Graceful shutdown of backend failed. This is expected if one of the workers has crashed.",
    "Traceback (most recent call last):",
    '  File "ray/train/torch/config.py", line 333, in on_shutdown',
    "ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.",
    "\tclass_name: RayTrainWorker",
    "\tpid: 27126",
    "\tip: 192.0.2.2",
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file.",
]


def test_a_traceback_block_goes_to_the_log_and_other_lines_stay():
    console, moved, still_open = split_tracebacks(["loading shards", *SURVIVOR], open_before=False)
    assert console == ["loading shards"] and moved == SURVIVOR and still_open
    # the rest of the block in the actor's next batch (indented) follows it; a new, plain line does not
    assert split_tracebacks(["    ^^^^", "x"], open_before=True) == ([], ["    ^^^^", "x"], True)
    assert split_tracebacks(["step 9 done"], open_before=True) == (["step 9 done"], [], False)
    # a Ray Train actor's thread that died (its own line first, then the traceback)
    thread = ["Exception in thread PlacementGroupCleanerMonitor:", "Traceback (most recent call last):"]
    assert split_tracebacks(thread, open_before=False) == ([], thread, True)


def test_a_dead_worker_is_one_line_naming_it_how_it_ended_and_the_restart_step():
    pid, line = lost_worker(CONTROLLER, restart_step=5)
    assert pid == "27126"
    assert line == (
        "raytrain: lost Train worker pid 27126 on 192.0.2.2 (no exit code: killed by a signal (SIGKILL, or the "
        f"OOM killer)); the group restarts from step 5; tracebacks in {WORKER_LOG}"
    )
    exited = [*CONTROLLER[:-1], "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker exits with an exit code 3."]
    assert "(exit code 3)" in lost_worker(exited, None)[1] and "from its start" in lost_worker(exited, None)[1]
    assert lost_worker(SURVIVOR, 5) is None, "the survivor's error names no dead worker"


def test_the_printer_gets_the_rest_and_the_line_is_printed_once(tmp_path, capsys):
    printed = []
    logs = WorkerLogs(tmp_path, out=sys.stderr)
    logs.printer = printed.append  # Ray's own printer, as __enter__ finds it
    for data in (
        {"actor_name": "RayTrainWorker", "pid": 27211, "is_err": True, "lines": ["hello", *SURVIVOR]},
        {"actor_name": "TrainController", "pid": 26811, "is_err": True, "lines": CONTROLLER},
        {"actor_name": "TrainController", "pid": 26811, "is_err": True, "lines": CONTROLLER},  # told once
        {"actor_name": "Board", "pid": 1, "is_err": True, "lines": ["Traceback (most recent call last):"]},
    ):
        logs.handle(data)
    assert [d["lines"] for d in printed] == [["hello"], ["Traceback (most recent call last):"]]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("raytrain: lost Train worker pid 27126")
    log = (tmp_path / WORKER_LOG).read_text()
    assert "Connection closed by peer" in log and log.count("ActorDiedError") == 2


def test_the_raylets_worker_death_message_is_the_same_one_line(tmp_path, capsys):
    logs = WorkerLogs(tmp_path, out=sys.stderr)
    printed = []
    raylet = (
        "A worker died or was killed while executing a task by an unexpected system error. Worker IP address: "
        "192.0.2.2 Worker port: 42907 Worker PID: 1771 Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
        "unexpectedly exits with a connection error code 2. End of file."
    )
    logs.handle({"pid": "raylet", "is_err": False, "lines": [raylet]}, printed.append)
    logs.handle({"pid": "raylet", "is_err": False, "lines": ["WARNING: 8 PYTHON worker processes"]}, printed.append)
    assert printed == [{"pid": "raylet", "is_err": False, "lines": ["WARNING: 8 PYTHON worker processes"]}]
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("raytrain: lost Train worker pid 1771 on 192.0.2.2 (no exit code")


def test_a_controllers_shutdown_report_is_moved_and_a_trials_lost_worker_names_its_trials_restart(tmp_path, capsys):
    # What `make demo` printed once as a trial's Train run ended: Ray's SIGTERM handler in the controller's
    # interpreter shutdown, which Python reports as an exception it cannot raise.
    shutdown = [
        "Exception ignored in: <module 'threading' from '/usr/lib/python3.11/threading.py'>",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/threading.py", line 1590, in _shutdown',
        "SystemExit: 1",
    ]
    printed = []
    logs = WorkerLogs(tmp_path, out=sys.stderr, experiment=True)
    logs.printer = printed.append
    logs.handle({"actor_name": "TrainController", "pid": 8758, "is_err": True, "lines": ["run ended", *shutdown]})
    logs.handle({"actor_name": "TrainController", "pid": 26811, "is_err": True, "lines": CONTROLLER})
    assert [d["lines"] for d in printed] == [["run ended"]]
    log = (tmp_path / WORKER_LOG).read_text()
    assert "Exception ignored in" in log and "SystemExit: 1" in log and "ActorDiedError" in log
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "raytrain: lost Train worker pid 27126 on 192.0.2.2 (no exit code: killed by a signal (SIGKILL, or the "
        f"OOM killer)); its trial's run restarts from its newest checkpoint; tracebacks in the experiment "
        f"folder's {WORKER_LOG}"
    )


def test_notices_a_user_cannot_act_on_go_to_the_log_from_any_process(tmp_path, capsys):
    """A trial actor's Tune advice and the controller's "safe to ignore" resource-request warning (with its
    traceback) are kept in the log; the rest of those batches reach the console."""
    printed = []
    logs = WorkerLogs(tmp_path, out=sys.stderr, experiment=True)
    logs.printer = printed.append
    setup = "INFO trainable.py:154 -- Trainable.setup took 11.412 seconds. If your trainable is slow ..."
    request = [
        "WARNING autoscaling_coordinator_client.py:73 -- Failed to send resource request for "
        "TrainController-1. If this only happens transiently during network partition or CPU being "
        "overloaded, it's safe to ignore this error. If this error persists, file a GitHub issue.",
        "Traceback (most recent call last):",
        '  File "/ray/train/v2/_internal/execution/scaling_policy/autoscaling_coordinator_client.py", line 60',
        "ray.exceptions.GetTimeoutError: Get timed out",
    ]
    logs.handle({"actor_name": "TrialRun", "pid": 7, "is_err": True, "lines": [setup, "a line of the trial's"]})
    logs.handle({"actor_name": "TrainController", "pid": 8, "is_err": True, "lines": request})
    assert [d["lines"] for d in printed] == [["a line of the trial's"]]
    log = (tmp_path / WORKER_LOG).read_text()
    assert "Trainable.setup took" in log and "GetTimeoutError" in log and "(TrialRun pid=7)" in log
    assert capsys.readouterr().err == ""
