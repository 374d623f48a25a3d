"""The local executor supervises real processes the way the sbatch script does."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

from relax_hpc.launch.local import LocalExecutor
from relax_hpc.launch.plan import JobPlan, RolePlan
from relax_hpc.paths import RunPaths

# A trainer that records its identity, then behaves as the file `behaviour` says.
TRAINER = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    run = pathlib.Path(sys.argv[1])
    restart = os.environ["RELAX_HPC_RESTART_COUNT"]
    # a rollout (of this start, or kept from an earlier one) installed its SIGTERM handler
    while not list(run.glob("rollout-ready-*")):
        time.sleep(0.01)
    (run / f"trainer-start-{restart}").write_text(os.environ["RELAX_HPC_RANK"])
    print("trainer log line for attempt", restart, flush=True)
    behaviour = (run / "behaviour").read_text().split()
    if behaviour[int(restart)] == "crash":
        sys.exit(13)
    if behaviour[int(restart)] == "wait-for-signal":
        def stop(signum, frame):
            (run / "trainer-checkpointed").write_text(signal.Signals(signum).name)
            sys.exit(75)
        signal.signal(signal.SIGTERM, stop)
        (run / "trainer-ready").write_text("")
        time.sleep(60)
    sys.exit(0)
    """
)
ROLLOUT = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    run = pathlib.Path(sys.argv[1])
    def stop(signum, frame):
        (run / "rollout-stopped").write_text("")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    (run / f"rollout-ready-{os.environ['RELAX_HPC_RESTART_COUNT']}").write_text("")
    time.sleep(60)
    """
)


def make_plan(tmp_path, max_restarts: int = 2) -> JobPlan:
    def role(name: str, source: str) -> RolePlan:
        script = tmp_path / f"{name}.py"
        script.write_text(source)
        return RolePlan(
            name, "test", 1, 1, 0, 1, 1, None, (sys.executable, str(script), str(tmp_path))
        )

    return JobPlan(
        name="t",
        run_dir=str(tmp_path),
        shape="hetjob",
        mode="async",
        roles=(role("trainer", TRAINER), role("rollout", ROLLOUT)),
        time_min=10,
        account=None,
        qos=None,
        signal_grace_s=5,
        max_restarts=max_restarts,
    )


def executor(tmp_path, behaviour: str, max_restarts: int = 2) -> LocalExecutor:
    (tmp_path / "behaviour").write_text(behaviour)
    return LocalExecutor(
        make_plan(tmp_path, max_restarts), RunPaths(tmp_path), poll_s=0.05, stop_timeout_s=20
    )


def test_a_finished_trainer_stops_the_rollout_cleanly(tmp_path):
    assert executor(tmp_path, "done").run() == 0
    assert (tmp_path / "rollout-stopped").exists()
    assert "attempt 0" in (tmp_path / "logs" / "trainer-0.log").read_text()


def test_a_crashing_trainer_is_restarted_alone_then_given_up(tmp_path, capsys):
    assert executor(tmp_path, "crash crash done").run() == 0
    assert {p.name for p in tmp_path.glob("trainer-start-*")} == {
        "trainer-start-0",
        "trainer-start-1",
        "trainer-start-2",
    }
    # the rollout task was started once and kept running through both trainer restarts
    assert [p.name for p in tmp_path.glob("rollout-ready-*")] == ["rollout-ready-0"]
    assert (tmp_path / "rollout-stopped").exists()  # stopped cleanly at the end
    err = capsys.readouterr().err
    assert "trainer[0] exited with 13" in err and "trainer log line for attempt 0" in err
    assert err.count("the trainer alone (the rollout workers keep running)") == 2

    other = tmp_path / "other"
    other.mkdir()
    assert executor(other, "crash crash crash", max_restarts=1).run() == 1
    err = capsys.readouterr().err
    assert "restart 1 of 1 from" in err and "restart 2 of 1" not in err
    assert "gave up after 1 restart(s) (cluster.max_restarts=1)" in err


# A rollout that finds a configuration error as a component does: record it, exit 2.
ROLLOUT_CONFIG_ERROR = textwrap.dedent(
    """
    import json, os, pathlib, sys
    run = pathlib.Path(sys.argv[1])
    (run / f"rollout-ready-{os.environ['RELAX_HPC_RESTART_COUNT']}").write_text("")
    (run / "status").mkdir(exist_ok=True)
    message = "model.path: /models/x cannot be loaded"
    (run / "status" / "config_error.json").write_text(json.dumps({"message": message}))
    print("relax_hpc: config error:", message, file=sys.stderr, flush=True)
    sys.exit(2)
    """
)


def test_a_config_error_of_any_role_ends_the_run_without_restarts(tmp_path, capsys):
    run = executor(tmp_path, "wait-for-signal wait-for-signal wait-for-signal")
    (tmp_path / "rollout.py").write_text(ROLLOUT_CONFIG_ERROR)  # the plan runs this file
    assert run.run() == 2
    assert [p.name for p in tmp_path.glob("rollout-ready-*")] == ["rollout-ready-0"]  # once
    err = capsys.readouterr().err
    assert "rollout[0] exited with 2" in err and "model.path: /models/x" in err
    assert "restart" not in err


def test_an_interrupt_is_forwarded_and_the_trainer_checkpoints(tmp_path):
    run = executor(tmp_path, "wait-for-signal")
    previous = signal.getsignal(signal.SIGINT)

    def interrupt_when_ready():
        deadline = time.monotonic() + 60
        while not (tmp_path / "trainer-ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    try:
        assert run.run() == 0  # a stop on request is not a failure (as on Slurm)
        assert run.end.outcome == "cancelled" and "(SIGINT)" in run.end.detail
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (tmp_path / "trainer-checkpointed").read_text() == "SIGTERM"
    assert (tmp_path / "rollout-stopped").exists()


# A rollout whose data file is broken: it dies with the same error at every start, recording
# it as a component does.
ROLLOUT_SAME_ERROR = textwrap.dedent(
    """
    import os, pathlib, sys
    from relax_hpc.component import record_task_error
    from relax_hpc.paths import RunPaths
    from relax_hpc.runtime import TaskIdentity
    run = pathlib.Path(sys.argv[1])
    (run / f"rollout-ready-{os.environ['RELAX_HPC_RESTART_COUNT']}").write_text("")
    error = ValueError("/data/train.jsonl:2: not JSON (Expecting value)")
    record_task_error(RunPaths(run), "rollout", TaskIdentity.from_environ(), error)
    sys.exit(1)
    """
)


def test_a_start_failing_like_the_one_before_is_not_restarted_again(tmp_path, capsys):
    run = executor(tmp_path, "wait-for-signal " * 4, max_restarts=3)
    (tmp_path / "rollout.py").write_text(ROLLOUT_SAME_ERROR)
    assert run.run() == 1
    assert sorted(p.name for p in tmp_path.glob("rollout-ready-*")) == [
        "rollout-ready-0",
        "rollout-ready-1",
    ]  # one restart (the error may have been transient), not three
    err = capsys.readouterr().err
    assert "restart 1 of 3" in err and "restart 2 of 3" not in err
    assert "rollout[0]: ValueError: /data/train.jsonl:2: not JSON" in err
    assert run.end is not None and run.end.outcome == "failed"


# A rollout task whose keeper gives up once the trainer was restarted alone: it records the
# failure under the start it was started by (0), as launch/keeper.py does.
ROLLOUT_GIVES_UP_LATER = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    run = pathlib.Path(sys.argv[1])
    (run / f"rollout-ready-{os.environ['RELAX_HPC_RESTART_COUNT']}").write_text("")
    while not (run / "trainer-start-1").exists():
        time.sleep(0.01)
    (run / "status").mkdir(exist_ok=True)
    record = {"restart": 0, "detail": "rollout worker r0 exited with 1 after 3 restart(s)"}
    (run / "status" / "component_failed.json").write_text(json.dumps(record))
    sys.exit(1)
    """
)


def test_a_kept_rollout_task_giving_up_fails_the_run_after_a_trainer_restart(tmp_path, capsys):
    run = executor(tmp_path, "crash wait-for-signal wait-for-signal", max_restarts=3)
    (tmp_path / "rollout.py").write_text(ROLLOUT_GIVES_UP_LATER)
    assert run.run() == 1
    assert run.end is not None and run.end.outcome == "failed"
    assert run.end.detail == "rollout worker r0 exited with 1 after 3 restart(s)"
    assert (tmp_path / "trainer-checkpointed").read_text() == "SIGTERM"  # stopped cleanly
    assert "restart 2 of 3" not in capsys.readouterr().err
