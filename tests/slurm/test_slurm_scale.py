"""``relax_hpc.scale`` on the real local Slurm cluster: an extra pool of a hetjob run is a
job of its own that joins the run, produces samples, drains and completes, while the
run's job keeps running; every sample is trained once."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_slurm_grpo_tiny import REPO, logs, submit

from relax_hpc.launch.slurm import job_state, wait_for_job
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once
from relax_hpc.spool.layout import SpoolLayout

pytestmark = pytest.mark.slurm


def scale(run_dir, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "relax_hpc.scale", str(run_dir), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=700, cwd=REPO)


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def test_an_extra_pool_is_a_job_that_joins_drains_and_completes(tmp_path):
    run_dir, paths = tmp_path / "run", RunPaths(tmp_path / "run")
    overrides = ["trainer.total_steps=100000", "observe.audit_sample_ids=true"]
    assert submit(run_dir, *overrides).returncode == 0
    job_id = str(read_json(paths.job_file)["job_id"])
    writer = SpoolLayout(paths.spool_dir).writer_status_path("rollout.xs.0")
    try:
        wait_until(lambda: read_json(paths.trainer_status, {}).get("step", 0) >= 2, 600, "step 2")
        added = scale(run_dir, "add", "1", "--pool", "xs", "--time-min", "10")
        assert added.returncode == 0, added.stderr
        pool_job = read_json(paths.pool_record("xs"))["job_id"]
        script = paths.pool_script("xs").read_text()
        assert "#SBATCH --no-requeue" in script and "--pool xs" in script
        wait_until(lambda: read_json(writer, {}).get("num_groups", 0) >= 2, 600, "pool samples")
        # sacct learns of a start from slurmctld a little later: until then it has no row
        running = lambda: job_state(pool_job)["State"] == "RUNNING"  # noqa: E731
        wait_until(running, 120, "the pool's job RUNNING in sacct")

        drained = scale(run_dir, "drain", "xs")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert wait_for_job(pool_job, timeout_s=300) == "COMPLETED", logs(run_dir)
        assert job_state(job_id)["State"] == "RUNNING"  # the run's job never noticed
        step = read_json(paths.trainer_status)["step"]
        wait_until(lambda: read_json(paths.trainer_status)["step"] >= step + 2, 300, "training")
        subprocess.run(
            [sys.executable, "-m", "relax_hpc.cancel", str(run_dir)],
            check=True,
            cwd=REPO,
            timeout=60,
        )
        assert wait_for_job(job_id, timeout_s=300) == "COMPLETED", logs(run_dir)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    trained = read_json(paths.consumed_sample_ids)
    assert not check_exactly_once({s for step in trained for s in step}, trained)
    assert "pool xs ended with exit code 0" in paths.pool_log("xs").read_text()
