"""How a start ends: one decision for the batch script and the local executor."""

from __future__ import annotations

import errno
import os
import shlex
import subprocess
import sys

import pytest

from relax_hpc import exitcodes
from relax_hpc.launch.outcome import (
    MB,
    decide_end,
    disk_full_detail,
    repeated_start_error,
    start_error,
)
from relax_hpc.launch.plan import build_job_plan
from relax_hpc.launch.sbatch import render_sbatch
from relax_hpc.paths import RunPaths, atomic_write_json, is_disk_full


def decide(trainer_exit: int, **facts):
    defaults = {
        "trainer_done": False,
        "config_error": None,
        "cancelled_by": None,
        "signal": None,
        "restarts": 0,
        "max_restarts": 3,
    }
    return decide_end(trainer_exit, **{**defaults, **facts})


@pytest.mark.parametrize(
    ("trainer_exit", "facts", "outcome", "exit_code"),
    [
        (exitcodes.DONE, {}, "finished", exitcodes.DONE),
        (-15, {"trainer_done": True}, "finished", exitcodes.DONE),  # killed after completing
        (exitcodes.CONFIG_ERROR, {}, "failed", exitcodes.CONFIG_ERROR),
        (exitcodes.CONFIG_ERROR, {"cancelled_by": "x"}, "failed", exitcodes.CONFIG_ERROR),
        (exitcodes.STOPPED, {"config_error": "model.path: no"}, "failed", exitcodes.CONFIG_ERROR),
        (exitcodes.STOPPED, {"cancelled_by": "python -m relax_hpc.cancel"}, "cancelled", 0),
        (exitcodes.STOPPED, {"signal": "SIGUSR1"}, "requeued", exitcodes.DONE),
        (13, {}, "requeued", exitcodes.DONE),
        (13, {"restarts": 3}, "failed", exitcodes.FAILED),
        (exitcodes.STOPPED, {"restarts": 3, "signal": "SIGTERM"}, "failed", exitcodes.FAILED),
    ],
)
def test_the_decision_table(trainer_exit, facts, outcome, exit_code):
    end = decide(trainer_exit, **facts)
    assert (end.outcome, end.exit_code) == (outcome, exit_code)
    assert end.requeue is (outcome == "requeued")


def test_details_say_why():
    assert "SIGUSR1: the trainer checkpointed" in decide(75, signal="SIGUSR1").detail
    crashed = decide(-9, signal="SIGTERM", restarts=2, max_restarts=2).detail
    assert "exited with -9 after SIGTERM" in crashed
    assert "gave up after 2 restart(s) (cluster.max_restarts=2)" in crashed
    rollout_found = decide(75, config_error="model.path: /m cannot be loaded").detail
    assert rollout_found.startswith("configuration error: model.path: /m cannot be loaded")


def shell_decision(run_dir, *args: str) -> dict[str, str]:
    """What the batch script gets: the command's assignments, evaluated by bash."""
    command = (
        f'eval "$({sys.executable} -m relax_hpc.launch.outcome {run_dir} {shlex.join(args)})"; '
        'printf "%s\\n" "$outcome" "$exit_code" "$requeue" "$detail"'
    )
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True)
    outcome, exit_code, requeue, detail = result.stdout.splitlines()
    return {"outcome": outcome, "exit_code": exit_code, "requeue": requeue, "detail": detail}


def test_the_batch_script_evaluates_the_same_decision(tmp_path):
    paths = RunPaths(tmp_path).create()
    common = ("--restarts", "1", "--max-restarts", "3")
    preempted = shell_decision(tmp_path, "--trainer-exit", "75", "--signal", "SIGUSR1", *common)
    assert preempted == {
        "outcome": "requeued",
        "exit_code": "0",
        "requeue": "1",
        "detail": decide(75, signal="SIGUSR1", restarts=1).detail,
    }
    atomic_write_json(paths.cancel_request, {})  # quotes and parentheses survive eval
    cancelled = shell_decision(tmp_path, "--trainer-exit", "75", "--signal", "", *common)
    assert cancelled["outcome"] == "cancelled" and cancelled["requeue"] == "0"
    assert cancelled["detail"] == "stopped on request (python -m relax_hpc.cancel); trainer exit 75"
    atomic_write_json(paths.config_error, {"field": "data.path", "message": "data.path: gone"})
    failed = shell_decision(tmp_path, "--trainer-exit", "75", *common)
    assert (failed["outcome"], failed["exit_code"]) == ("failed", "2")
    assert "data.path: gone" in failed["detail"]
    atomic_write_json(paths.trainer_done, {})
    assert shell_decision(tmp_path, "--trainer-exit", "-9", *common)["outcome"] == "finished"


def test_the_sbatch_script_asks_the_decision_and_spells_no_exit_code_itself(tmp_path):
    from relax_hpc.config.compose import compose_run_config

    cfg = compose_run_config(["+experiment=grpo_tiny", "cluster=slurm"])
    script = render_sbatch(build_job_plan(cfg, str(tmp_path)))
    assert "-m relax_hpc.launch.outcome" in script and 'eval "$decision"' in script
    # pytest's temporary folder may hold any number (pytest-375): leave it out of the search
    script_text = script.replace(str(tmp_path), "RUN_DIR")
    assert "75" not in script_text and "case \"$trainer_rc\"" not in script_text
    assert f"exit {exitcodes.RUN_IN_USE}\n" in script


def record_error(paths: RunPaths, role: str, restart: int, error: str, rank: int = 0) -> None:
    """What ``component.record_task_error`` writes when a task ends with an exception."""
    from relax_hpc.component import record_task_error
    from relax_hpc.runtime import TaskIdentity

    identity = TaskIdentity(rank, 1, 0, "local-1", restart, "local")
    record_task_error(paths, role, identity, ValueError(error))


def test_the_same_error_before_the_first_step_twice_in_a_row_ends_the_run(tmp_path):
    paths = RunPaths(tmp_path).create()
    not_json = "data/train.jsonl:2: not JSON (Expecting value)"
    record_error(paths, "rollout", 0, not_json)
    assert repeated_start_error(paths, 0) is None  # the first time: maybe transient
    assert decide(1, restarts=0, repeated_error=None).outcome == "requeued"
    record_error(paths, "rollout", 1, not_json)
    repeated = repeated_start_error(paths, 1)
    assert repeated == f"rollout[0]: ValueError: {not_json}"
    end = decide(75, restarts=1, repeated_error=repeated)
    assert (end.outcome, end.exit_code, end.requeue) == ("failed", exitcodes.FAILED, False)
    assert not_json in end.detail and "the same error as the start before" in end.detail
    # The batch script gets the same decision from the same files.
    record_error(paths, "rollout", 2, not_json)
    batch = shell_decision(tmp_path, "--trainer-exit", "75", "--restarts", "2", "--max-restarts", "3")
    assert (batch["outcome"], batch["requeue"]) == ("failed", "0")
    assert not_json in batch["detail"]


def test_a_step_between_or_another_error_is_restarted_as_before(tmp_path):
    paths = RunPaths(tmp_path).create()
    record_error(paths, "trainer", 0, "CUDA error: an illegal memory access")
    assert repeated_start_error(paths, 0) is None
    atomic_write_json(paths.trainer_status, {"step": 3, "time": 1.0})  # start 1 trained
    record_error(paths, "trainer", 1, "CUDA error: an illegal memory access")
    assert repeated_start_error(paths, 1) is None
    record_error(paths, "trainer", 2, "NCCL timeout")  # no step, but another error
    assert repeated_start_error(paths, 2) is None
    assert repeated_start_error(paths, 3) is None  # a start without a task error (preempted)
    record_error(paths, "trainer", 4, "NCCL timeout")  # the one before it had no error
    assert repeated_start_error(paths, 4) is None


def test_the_first_task_error_of_the_start_is_its_cause(tmp_path):
    paths = RunPaths(tmp_path).create()
    record_error(paths, "rollout", 0, "an old start's error")  # another start: not this one's
    record_error(paths, "rollout", 1, "line 2: not JSON", rank=1)
    record_error(paths, "trainer", 1, "the rollout went away")  # a consequence, later
    assert start_error(paths, 1) == "rollout[1]: ValueError: line 2: not JSON"


def test_a_full_filesystem_ends_the_run_with_one_line_saying_what_to_free(tmp_path):
    paths = RunPaths(tmp_path).create()
    assert disk_full_detail(paths, 0) is None  # plenty free, no task said so
    checkpoint = paths.checkpoint_dir(4)
    checkpoint.mkdir(parents=True)
    (checkpoint / "weights").write_bytes(b"\0" * (3 * MB))
    disk_full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    wrapped = RuntimeError(  # how DCP reports a rank's failure: as text
        "CheckpointException ranks:dict_keys([0])\nOSError: [Errno 28] No space left on device"
    )
    assert is_disk_full(disk_full) and is_disk_full(wrapped) and not is_disk_full(ValueError("x"))
    try:
        raise RuntimeError("saving failed") from disk_full
    except RuntimeError as chained:
        assert is_disk_full(chained)
    record_error(paths, "trainer", 0, "ignored")  # a ValueError: not a full disk
    assert disk_full_detail(paths, 0) is None
    from relax_hpc.component import record_task_error
    from relax_hpc.runtime import TaskIdentity

    record_task_error(paths, "trainer", TaskIdentity(0, 1, 0, "j", 0, "local"), wrapped)
    detail = disk_full_detail(paths, 0)
    assert detail.startswith("the run directory's filesystem is full (")
    assert "a checkpoint takes 3.0 MB" in detail and f"resume with run_dir={paths.root}" in detail
    end = decide(1, restarts=0, disk_full=detail)
    assert (end.outcome, end.exit_code, end.detail) == ("failed", exitcodes.FAILED, detail)


@pytest.fixture
def full_filesystem(tmp_path):
    """A real filesystem with no space left: a 64 kB tmpfs, filled (root only)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]
    ).returncode:
        pytest.skip("mounting a tmpfs needs root")
    RunPaths(mount).create()
    try:
        with open(mount / "filler", "wb") as handle:
            while True:
                handle.write(b"\0" * 4096)
                handle.flush()
    except OSError as err:
        assert err.errno == errno.ENOSPC
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_the_supervisors_own_writes_never_raise_on_a_full_filesystem(full_filesystem):
    from relax_hpc.observe.alerts import AlertState
    from relax_hpc.observe.cost import CostLedger

    paths = RunPaths(full_filesystem)
    ledger = CostLedger(paths.cost_ledger)
    ledger.start_attempt("j", 0)
    ledger.tick()
    assert ledger.write_failed and not paths.cost_ledger.exists()
    AlertState(paths.alert_state).save({"once": []})
    record_error(paths, "trainer", 0, "the record itself cannot be written")
    assert repeated_start_error(paths, 0) is None
    assert "filesystem is full (0.0 MB free" in disk_full_detail(paths, 0)  # from statvfs
