"""The keeper of a rollout task (launch/keeper.py) with real child processes.

The worker here is a short Python script in place of the rollout (which needs a model):
what the keeper sees of a worker is only its exit code and its heartbeat file, and both
are real here. Each script counts its starts in a file so that a test can make the first
start crash or hang and a later one finish.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from relax_hpc import exitcodes
from relax_hpc.launch.keeper import FORWARDED, KeeperPolicy, TaskKeeper
from relax_hpc.launch.outcome import decide_end, recorded_component_failure
from relax_hpc.observe.events import read_events
from relax_hpc.paths import RunPaths, atomic_write_json
from relax_hpc.rollout.assignment import heartbeat_path
from relax_hpc.runtime import TaskIdentity


@pytest.fixture(autouse=True)
def keep_signal_handlers():
    """TaskKeeper.run installs handlers for a whole process; give pytest its own back."""
    saved = {signum: signal.getsignal(signum) for signum in FORWARDED}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


FAST = KeeperPolicy(max_restarts=2, backoff_s=0.05, hang_after_s=1.0, poll_s=0.05)


def identity(pool: str | None = None, restart_count: int = 0) -> TaskIdentity:
    return TaskIdentity(0, 1, 0, "local-1", restart_count, "local", pool)


def worker_script(tmp_path, body: str) -> list[str]:
    """A command whose start number (1, 2, ...) is ``start`` inside ``body``."""
    counter = tmp_path / "starts"
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, signal, sys, time
            from pathlib import Path
            counter = Path({str(counter)!r})
            start = int(counter.read_text()) + 1 if counter.exists() else 1
            counter.write_text(str(start))
            """
        )
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


def keeper(tmp_path, command, policy=FAST, pool=None) -> tuple[TaskKeeper, RunPaths]:
    paths = RunPaths(tmp_path / "run").create()
    worker = "r0" if pool is None else f"{pool}.0"
    return TaskKeeper(paths, worker, identity(pool), command, policy), paths


def starts(tmp_path) -> int:
    return int((tmp_path / "starts").read_text())


def test_a_crashed_worker_is_restarted_in_place_and_the_restart_is_an_event(tmp_path):
    command = worker_script(tmp_path, "sys.exit(1 if start == 1 else 0)")
    kept, paths = keeper(tmp_path, command)
    assert kept.run() == exitcodes.DONE
    assert starts(tmp_path) == 2
    events = [record for _, record in read_events(paths, "component_")]
    assert [e["event"] for e in events] == ["component_restarted"]
    assert events[0]["component"] == "rollout/r0" and events[0]["exit_code"] == 1
    assert events[0]["restarts"] == 1 and events[0]["max_restarts"] == 2
    assert not paths.component_failure.exists()


def test_a_worker_that_crashes_every_time_is_given_up_and_fails_the_start(tmp_path):
    # each start records its error as component.main does for the run's own workers
    command = worker_script(
        tmp_path,
        f"""
        from relax_hpc.component import record_task_error
        from relax_hpc.paths import RunPaths
        from relax_hpc.runtime import TaskIdentity
        error = OSError(f"no usable device (start {{start}})")
        record_task_error(RunPaths({str(tmp_path / "run")!r}), "rollout",
                          TaskIdentity.from_environ(), error)
        sys.exit(7)
        """,
    )
    kept, paths = keeper(tmp_path, command)
    assert kept.run() == 7
    assert starts(tmp_path) == 1 + FAST.max_restarts
    kinds = [record["event"] for _, record in read_events(paths, "component_")]
    assert kinds == ["component_restarted"] * 2 + ["component_gave_up"]
    detail = recorded_component_failure(paths, restarts=0)
    assert "rollout worker r0 exited with 7 after 2 restart(s)" in detail
    assert "rollout.max_restarts=2" in detail
    assert "last error: OSError: no usable device (start 3)" in detail  # the last start's
    ((_, gave_up),) = read_events(paths, "component_gave_up")
    assert gave_up["last_error"] == "OSError: no usable device (start 3)"
    end = decide_end(
        exitcodes.STOPPED,  # the trainer stopped with a checkpoint when the task ended
        trainer_done=False,
        config_error=None,
        cancelled_by=None,
        signal=None,
        restarts=0,
        max_restarts=3,
        component_failure=detail,
    )
    assert end.outcome == "failed" and not end.requeue and end.detail == detail
    # a later start does not fail on an earlier start's record
    assert recorded_component_failure(paths, restarts=1) is None


def test_an_extra_pool_worker_that_is_given_up_leaves_without_failing_the_run(tmp_path):
    log = RunPaths(tmp_path / "run").task_log("rollout", "extra.0")
    command = worker_script(
        tmp_path,
        f"""
        log = Path({str(log)!r})
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:  # a pool worker's traceback, as its log shows it
            out.write("Traceback (most recent call last):\\n  File ...\\n")
            out.write(f"RuntimeError: engine lost its device (start {{start}})\\n\\n")
        sys.exit(7)
        """,
    )
    kept, paths = keeper(tmp_path, command, pool="extra")
    assert kept.run() == 7
    assert not paths.component_failure.exists()
    ((_, gave_up),) = read_events(paths, "component_gave_up")
    assert gave_up["last_error"] == "RuntimeError: engine lost its device (start 3)"
    assert "last error: RuntimeError: engine lost its device (start 3)" in gave_up["detail"]


def test_a_worker_whose_heartbeat_stops_is_killed_and_restarted(tmp_path):
    beat = heartbeat_path(RunPaths(tmp_path / "run").rollout_assignment_dir, "r0")
    command = worker_script(
        tmp_path,
        f"""
        if start == 1:  # beats once, long ago, then hangs
            beat = Path({str(beat)!r})
            beat.parent.mkdir(parents=True, exist_ok=True)
            beat.write_text(json.dumps({{"pid": os.getpid(), "time": time.time() - 60}}))
            time.sleep(600)
        sys.exit(0)
        """,
    )
    kept, paths = keeper(tmp_path, command)
    began = time.monotonic()
    assert kept.run() == exitcodes.DONE
    assert time.monotonic() - began < 60  # it did not wait out the sleep
    assert starts(tmp_path) == 2
    ((_, event),) = read_events(paths, "component_restarted")
    assert event["reason"].startswith("hung: no heartbeat for") and event["exit_code"] == -9


def test_a_heartbeat_of_another_process_is_not_a_hang(tmp_path):
    paths = RunPaths(tmp_path / "run").create()
    beat = heartbeat_path(paths.rollout_assignment_dir, "r0")
    beat.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(beat, {"pid": 1, "time": time.time() - 600})  # an earlier worker's
    command = worker_script(tmp_path, "time.sleep(1.5); sys.exit(0)")
    kept = TaskKeeper(paths, "r0", identity(), command, FAST)
    assert kept.run() == exitcodes.DONE
    assert starts(tmp_path) == 1


def test_a_restart_requested_by_the_watcher_kills_and_restarts_the_worker(tmp_path):
    command = worker_script(tmp_path, "time.sleep(600) if start == 1 else sys.exit(0)")
    kept, paths = keeper(tmp_path, command)
    request = paths.restart_request("r0")
    request.parent.mkdir(parents=True, exist_ok=True)

    def ask_once_started() -> None:  # a kill before the start is counted would start 1 again
        deadline = time.monotonic() + 30
        while not (tmp_path / "starts").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        atomic_write_json(request, {"reason": "no step for 30 min; r0 published nothing"})

    threading.Thread(target=ask_once_started, daemon=True).start()
    assert kept.run() == exitcodes.DONE
    assert not request.exists()
    ((_, event),) = read_events(paths, "component_restarted")
    assert "restart requested (no step for 30 min" in event["reason"]


@pytest.mark.parametrize("code", [exitcodes.STOPPED, exitcodes.CONFIG_ERROR])
def test_a_stop_or_a_config_error_is_not_restarted(tmp_path, code):
    command = worker_script(tmp_path, f"sys.exit({code})")
    kept, paths = keeper(tmp_path, command)
    assert kept.run() == code
    assert starts(tmp_path) == 1 and read_events(paths, "component_") == []


def test_a_crash_after_training_ended_is_not_restarted(tmp_path):
    command = worker_script(tmp_path, "sys.exit(1)")
    kept, paths = keeper(tmp_path, command)
    paths.trainer_done.parent.mkdir(parents=True, exist_ok=True)
    paths.trainer_done.write_text("{}")
    assert kept.run() == 1
    assert starts(tmp_path) == 1


def test_sigterm_to_the_keeper_reaches_the_worker_and_nothing_restarts(tmp_path):
    ready = tmp_path / "ready"
    command = worker_script(
        tmp_path,
        f"""
        signal.signal(signal.SIGTERM, lambda *_: sys.exit({exitcodes.STOPPED}))
        Path({str(ready)!r}).write_text("1")
        time.sleep(600)
        """,
    )
    kept, _ = keeper(tmp_path, command)

    def terminate_when_ready() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the keeper in the main thread

    threading.Thread(target=terminate_when_ready, daemon=True).start()
    assert kept.run() == exitcodes.STOPPED
    assert starts(tmp_path) == 1 and kept.stopping == "SIGTERM"


def test_a_drain_waits_for_the_restarted_worker_not_the_left_of_the_one_that_ended(tmp_path):
    """A worker that said it left (its heartbeat's stop) and then crashed is restarted; the
    heartbeat must not say 'left' for the new process, or drain reports it gone."""
    from relax_hpc.scale import draining_workers

    beat = heartbeat_path(RunPaths(tmp_path / "run").rollout_assignment_dir, "extra.0")
    go = tmp_path / "go"
    command = worker_script(
        tmp_path,
        f"""
        if start == 1:  # left=True as WorkerHeartbeat.stop writes it, then a crash
            beat = Path({str(beat)!r})
            beat.parent.mkdir(parents=True, exist_ok=True)
            beat.write_text(json.dumps({{"pid": os.getpid(), "time": time.time(), "left": True}}))
            sys.exit(1)
        while not Path({str(go)!r}).exists():  # the new worker, still loading its model
            time.sleep(0.05)
        sys.exit(0)
        """,
    )
    kept, paths = keeper(tmp_path, command, pool="extra")
    seen: list[list[str]] = []

    def drain_while_restarted() -> None:
        deadline = time.monotonic() + 120
        while not (tmp_path / "starts").exists() or starts(tmp_path) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seen.append(draining_workers(paths, "extra"))
        go.touch()

    thread = threading.Thread(target=drain_while_restarted, daemon=True)
    thread.start()
    try:
        assert kept.run() == exitcodes.DONE
    finally:
        go.touch()
        thread.join(timeout=30)
    assert seen == [["extra.0"]]  # the restarted worker was still to be waited for
    assert draining_workers(paths, "extra") == []  # and its keeper is gone now
