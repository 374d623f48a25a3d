"""grpo_tiny submitted to the real local Slurm cluster as one heterogeneous job."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.launch.slurm import job_state, submit_script, wait_for_job
from relax_hpc.paths import RunPaths, read_json

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
FAST = [
    "rollout.eval_interval_steps=10",
    "trainer.checkpoint_interval_steps=10",
    "cluster.time_min=20",
]


def submit(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "relax_hpc.submit",
        "+experiment=grpo_tiny",
        "cluster=slurm",
        f"run_dir={run_dir}",
        *FAST,
        *overrides,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)


def logs(run_dir: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted(RunPaths(run_dir).logs_dir.glob("*.log"))
    )


def test_grpo_tiny_hetjob_runs_to_completion_and_learns(tmp_path):
    run_dir = tmp_path / "run"
    result = submit(run_dir, "trainer.total_steps=40")
    assert result.returncode == 0, result.stderr
    job_id = str(read_json(RunPaths(run_dir).job_file)["job_id"])
    try:
        state = wait_for_job(job_id, timeout_s=900)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", logs(run_dir)
    components = job_state(job_id)["Components"]
    assert components.startswith("0:COMPLETED,1:COMPLETED"), components  # <id>+0 and <id>+1
    history = read_json(RunPaths(run_dir).status_dir / "eval.json")["history"]
    assert history[-1]["policy_version"] == 40
    assert history[-1]["accuracy"] > history[0]["accuracy"] + 0.2, history
    trainer_log = (RunPaths(run_dir).task_log("trainer", 0)).read_text()
    assert "of job attempt" in trainer_log and "(slurm)" in trainer_log
    status = subprocess.run(
        [sys.executable, "-m", "relax_hpc.status", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert f"Slurm job {job_id} COMPLETED" in status.stdout and "trainer: finished" in status.stdout


def test_a_job_whose_steps_fail_is_seen_as_failed(tmp_path):
    run_dir = tmp_path / "run"
    assert submit(run_dir, "prepare_only=true").returncode == 0
    paths = RunPaths(run_dir)
    text = paths.resolved_config.read_text().replace("seed: 1", "seed: 1\nsede: 2", 1)
    paths.resolved_config.write_text(text)  # every step now exits with a config error (2)
    job_id = submit_script(paths, paths.sbatch_script.read_text())
    state = wait_for_job(job_id, timeout_s=180)
    assert state == "FAILED", logs(run_dir)
    assert "config error" in logs(run_dir)


def test_cancel_stops_with_a_checkpoint_and_no_requeue(tmp_path):
    run_dir = tmp_path / "run"
    assert submit(run_dir, "trainer.total_steps=2000").returncode == 0
    paths = RunPaths(run_dir)
    job_id = str(read_json(paths.job_file)["job_id"])
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            status = paths.status_dir / "trainer.json"
            if status.exists() and read_json(status)["step"] >= 3:
                break
            time.sleep(0.5)
        subprocess.run(
            [sys.executable, "-m", "relax_hpc.cancel", str(run_dir)],
            check=True,
            cwd=REPO,
            timeout=60,
        )
        state = wait_for_job(job_id, timeout_s=300)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", logs(run_dir)
    checkpoints = sorted(p.name for p in paths.checkpoints_dir.iterdir())
    stopped_at = read_json(paths.status_dir / "trainer.json")["step"]
    assert f"step_{stopped_at:08d}" in checkpoints and stopped_at < 2000
    assert "not requeueing" in logs(run_dir)


def wait_for_restart_and_step(
    paths: RunPaths, log_marker: str, step: int, timeout_s: float
) -> None:
    """Until the trainer log shows ``log_marker`` and the trainer has reached ``step``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = paths.task_log("trainer", 0)
        status = paths.status_dir / "trainer.json"
        restarted = log.exists() and log_marker in log.read_text(errors="replace")
        if restarted and status.exists() and read_json(status)["step"] >= step:
            return
        time.sleep(0.5)
    raise AssertionError(f"no {log_marker!r} with step >= {step} within {timeout_s} s")


def test_preempted_twice_the_run_finishes_with_every_sample_trained_once(tmp_path):
    """An advance warning (USR1 to the batch shell: checkpoint, then requeue) and a hard
    requeue by Slurm (scontrol requeue: the steps are killed) in one run."""
    run_dir = tmp_path / "run"
    overrides = [
        "trainer.total_steps=40",
        "observe.audit_sample_ids=true",
        "cluster.max_restarts=4",
    ]
    assert submit(run_dir, *overrides).returncode == 0
    paths = RunPaths(run_dir)
    job_id = str(read_json(paths.job_file)["job_id"])
    try:
        wait_for_restart_and_step(paths, "attempt", 8, timeout_s=600)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
        wait_for_restart_and_step(paths, f"attempt {job_id}.1", 20, timeout_s=600)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        wait_for_restart_and_step(paths, f"attempt {job_id}.2", 21, timeout_s=600)
        state = wait_for_job(job_id, timeout_s=900)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert state == "COMPLETED", logs(run_dir)
    trainer_log = paths.task_log("trainer", 0).read_text()
    assert trainer_log.count("trainer: resumed from") == 2, trainer_log[-3000:]
    assert "stopping at step" in trainer_log  # the USR1 path checkpointed before requeueing
    surviving = read_json(paths.status_dir / "consumed_sample_ids.json")
    assert len(surviving) == 40
    from relax_hpc.spool import check_exactly_once

    assert not check_exactly_once({s for step in surviving for s in step}, surviving)
