"""A crashed trainer is restarted alone: the rollout workers keep their processes.

A local run's trainer is SIGKILLed (no warning, no final checkpoint) between two
checkpoints. The supervisor restarts the trainer alone from its last complete checkpoint
(``launch/local.py``); the rollout task's keeper and its worker keep their pids, the
worker's engine rejoins the new trainer start's weight sync (``weightsync/receiver.py``)
and the run finishes. Exactly-once is checked against the sample ids read from every
shard that left ``ready/`` (``spool.keep_consumed``), not against the trained ids: what
the dead trainer consumed after its checkpoint is trained again by the new start, once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from e2e_helpers import (
    REPO,
    failure_report,
    is_running,
    submit_command,
    submit_env,
    trained_and_published,
    wait_for_step,
)
from run_checks import rollout_pids

from relax_hpc.checkpoint.store import latest_checkpoint
from relax_hpc.observe.events import read_events
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once

pytestmark = pytest.mark.slow
STEPS = 14
KILL_AT_STEP = 5  # after the checkpoint of step 3 (or 6): the steps after it are trained again
OVERRIDES = [
    "mode=hybrid",  # on-policy: no group is dropped as stale, so every shard is trained
    "max_staleness=0",
    "rollout.prompts_per_step=6",
    "rollout.n_samples_per_prompt=4",
    "rollout.eval_interval_steps=0",
    "model.warm_start=false",
    f"trainer.total_steps={STEPS}",
    "trainer.checkpoint_interval_steps=3",
    "cluster.max_restarts=1",
    "observe.audit_sample_ids=true",
    "spool.keep_consumed=true",
]


def wait_for_new_trainer_step(paths: RunPaths, killed_at: float, run) -> bool:
    """Until a trainer start after ``killed_at`` (wall clock) reported a training step: True;
    False when the run finished first (its steps after the restart were quicker than a look)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = read_json(paths.trainer_status, default={})
        if status.get("time", 0) > killed_at and "resumed from" in trainer_log(paths):
            return run.poll() is None
        if run.poll() is not None:
            return False
        time.sleep(0.2)
    raise AssertionError("the restarted trainer took no step within 600 s")


def trainer_log(paths: RunPaths) -> str:
    path = paths.task_log("trainer", 0)
    return path.read_text(errors="replace") if path.exists() else ""


def test_a_sigkilled_trainer_restarts_alone_and_the_rollout_keeps_its_processes(tmp_path):
    run_dir, paths = tmp_path / "run", RunPaths(tmp_path / "run")
    run = subprocess.Popen(
        submit_command(run_dir, *OVERRIDES),
        cwd=REPO,
        env=submit_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_step(paths.trainer_status, KILL_AT_STEP, run, timeout_s=600)
    before = rollout_pids(run_dir)
    assert len(before) == 2, before  # the keeper and its worker
    worker_pid = read_json(paths.rollout_assignment_dir / "workers" / "r0.json")["pid"]
    trainer_pid = read_json(paths.rendezvous_dir / "trainer.json")["pid"]
    os.kill(trainer_pid, signal.SIGKILL)
    killed_at = time.time()
    # what the restart must resume from (the new start takes seconds to save another)
    checkpoint_at_kill = latest_checkpoint(paths).step

    if wait_for_new_trainer_step(paths, killed_at, run):  # seen while it runs: same processes
        assert rollout_pids(run_dir) == before and all(map(is_running, before))
    _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, failure_report(
        subprocess.CompletedProcess([], run.returncode, "", stderr), run_dir
    )
    assert "trainer[0] exited with -9" in stderr
    assert "restart 1 of 1 from the last complete checkpoint: the trainer alone" in stderr
    resumed = trainer_log(paths).split("trainer rank 0/1 of job")[-1]
    resumed_step = int(resumed.split("resumed from ")[1].split("(step ")[1].split(")")[0])
    assert resumed_step == checkpoint_at_kill >= 3, resumed[-3000:]
    rollout_log = paths.task_log("rollout", 0).read_text(errors="replace")
    assert "lost the trainer" in rollout_log and "rejoined the trainer's new start" in rollout_log
    assert "restart 1 of" not in rollout_log, rollout_log[-3000:]  # the keeper restarted nothing
    assert rollout_log.count("worker started (pid") == 1
    assert f"worker started (pid {worker_pid})" in rollout_log

    trained, samples = trained_and_published(paths)
    assert len(trained) == STEPS
    published = {sample.sample_id for sample in samples}
    assert not check_exactly_once(published, trained)  # none lost, none twice
    counters = read_json(paths.spool_dir / "reader.json")["counters"]
    assert counters.get("num_lost_groups", 0) == counters.get("num_stale_groups", 0) == 0
    assert len(read_json(paths.cost_ledger)["attempts"]) == 2
    events = [record for _, record in read_events(paths, "trainer_restarted")]
    assert [event["restarts"] for event in events] == [1], events
    assert_status_lists_the_restart(run_dir, resumed_step)


def assert_status_lists_the_restart(run_dir, resumed_step: int) -> None:
    """An operator's ``python -m relax_hpc.status`` names the recovery and its cause."""
    shown = subprocess.run(
        [sys.executable, "-m", "relax_hpc.status", str(run_dir)],
        cwd=REPO,
        env=submit_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    (count,) = [line for line in lines if line.startswith("recoveries: ")]
    assert "trainer_restarted 1" in count, shown.stdout
    restarted = f"trainer restarted alone (restart 1) from the checkpoint of step {resumed_step}: "
    assert any(restarted in line and "exited with -9" in line for line in lines), shown.stdout
