"""A crashed trainer restarts alone inside its Slurm job; the rollout step keeps running.

The trainer process inside its hetjob step is SIGKILLed (no warning, no final checkpoint)
between two checkpoints. The batch script starts the trainer's step again, alone, in the
same allocation (``launch/sbatch.py``): the rollout step's keeper and worker keep their
pids, the worker rejoins the new trainer start's weight sync, the job is never requeued
and ends COMPLETED. Exactly-once is checked against the sample ids read from every shard
that left ``ready/`` (``spool.keep_consumed``), not against the trained ids.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from run_checks import rollout_pids, trained_and_published
from test_slurm_grpo_tiny import logs, resumed_step, submit

from relax_hpc.checkpoint.store import latest_checkpoint
from relax_hpc.launch.slurm import job_state, wait_for_job
from relax_hpc.observe.events import read_events
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
# The kill lands within a second of step KILL_AT_STEP; the steps after it are the margin
# that keeps the run from finishing first, and what the restarted trainer must train.
STEPS = 24
KILL_AT_STEP = 4  # after the checkpoint of step 3: the steps after it are trained again
OVERRIDES = [
    "mode=hybrid",  # on-policy: no group is dropped as stale, so every shard is trained
    "max_staleness=0",
    "rollout.eval_interval_steps=0",
    "model.warm_start=false",
    f"trainer.total_steps={STEPS}",
    "trainer.checkpoint_interval_steps=3",
    "cluster.max_restarts=1",
    "observe.audit_sample_ids=true",
    "spool.keep_consumed=true",
    "trainer.mem_gb=1",
    "rollout.mem_gb=1",
]
WAIT_S = 600  # generous: a loaded machine is slow, never wrong


def wait_for_trainer_step(paths: RunPaths, job_id: str, step: int) -> None:
    """Until the trainer reported ``step``; fails at once when the job ended before it."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        status = read_json(paths.trainer_status, default={})
        if status.get("step", -1) >= step:
            return
        if job_state(job_id)["State"] not in ("PENDING", "RUNNING", "REQUEUED"):
            raise AssertionError(f"job {job_id} ended before step {step}:\n{logs(paths.root)}")
        time.sleep(0.2)
    raise AssertionError(f"no trainer step {step} within {WAIT_S} s:\n{logs(paths.root)}")


def sigkill_the_trainer(paths: RunPaths) -> int:
    """SIGKILL to the trainer process inside its step; the step it had reported."""
    pid = read_json(paths.rendezvous_dir / "trainer.json")["pid"]
    os.kill(pid, signal.SIGKILL)
    step = read_json(paths.trainer_status)["step"]
    assert step < STEPS and not paths.trainer_done.exists(), (
        f"the run reached step {step} of {STEPS} before the kill landed: give it more steps"
    )
    return step


def wait_for_the_new_start(paths: RunPaths, marker: str, after_step: int) -> bool:
    """Until the trainer start after ``marker`` reported a step past ``after_step``: True;
    False when the run finished first (its remaining steps were quicker than a look)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        text = paths.task_log("trainer", 0).read_text(errors="replace")
        restarted = marker in text and "trainer: resumed from" in text.split(marker, 1)[1]
        if restarted and read_json(paths.trainer_status, default={}).get("step", 0) > after_step:
            return not paths.trainer_done.exists()
        if paths.trainer_done.exists():
            return False
        time.sleep(0.2)
    raise AssertionError(f"the restarted trainer took no step within {WAIT_S} s")


def sacct_states(job_id: str) -> list[str]:
    """One state per run of the job (``-D``: a requeue leaves a REQUEUED row)."""
    out = subprocess.run(
        ["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.split()


def test_a_sigkilled_trainer_restarts_alone_in_its_job_and_the_rollout_step_keeps_running(
    tmp_path,
):
    run_dir = tmp_path / "run"
    result = submit(run_dir, *OVERRIDES)
    assert result.returncode == 0, result.stderr
    paths = RunPaths(run_dir)
    job_id = str(read_json(paths.job_file)["job_id"])
    try:
        wait_for_trainer_step(paths, job_id, KILL_AT_STEP)
        worker_pid = read_json(paths.rollout_assignment_dir / "workers" / "r0.json")["pid"]
        before = rollout_pids(run_dir)
        assert worker_pid in before, (worker_pid, before)
        killed_step = sigkill_the_trainer(paths)
        checkpoint_at_kill = latest_checkpoint(paths).step  # before the new start saves one
        if wait_for_the_new_start(paths, f"attempt {job_id}.1", killed_step):
            assert rollout_pids(run_dir) == before  # seen while it runs: the same processes
        state = wait_for_job(job_id, timeout_s=WAIT_S)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", logs(run_dir)
    assert "REQUEUED" not in sacct_states(job_id), sacct_states(job_id)
    batch_log = (paths.logs_dir / f"batch-{job_id}.log").read_text()
    assert "restart 1 of 1 from the last complete checkpoint: the trainer alone" in batch_log
    assert "requeueing job" not in batch_log and batch_log.count(" start 1 on ") == 1

    trainer_log = paths.task_log("trainer", 0).read_text()
    assert resumed_step(trainer_log, f"attempt {job_id}.1") == checkpoint_at_kill >= 3
    assert read_json(paths.trainer_status)["step"] == STEPS
    rollout_log = paths.task_log("rollout", 0).read_text(errors="replace")
    assert "lost the trainer" in rollout_log and "rejoined the trainer's new start" in rollout_log
    assert rollout_log.count("worker started (pid") == 1  # the keeper restarted nothing
    assert f"worker started (pid {worker_pid})" in rollout_log
    events = [record for _, record in read_events(paths, "trainer_restarted")]
    assert [event["restarts"] for event in events] == [1], events

    trained, samples = trained_and_published(paths)
    assert len(trained) == STEPS
    published = {sample.sample_id for sample in samples}
    assert not check_exactly_once(published, trained)  # none lost, none twice
    counters = read_json(paths.spool_dir / "reader.json")["counters"]
    assert counters.get("num_lost_groups", 0) == counters.get("num_stale_groups", 0) == 0
    assert len(read_json(paths.cost_ledger)["attempts"]) == 2
