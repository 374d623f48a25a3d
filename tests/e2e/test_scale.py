"""``python -m relax_hpc.scale`` on a local run: an extra pool of rollout workers joins while
the trainer trains, takes prompt groups from the same claims, is restarted in place when
killed (the trainer keeps training, the run is not restarted), drains and leaves; every
sample is trained once. Then the run is cancelled and the pool's supervisor is gone too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from e2e_helpers import REPO, is_running, submit_command, submit_env, wait_for_step

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once
from relax_hpc.spool.layout import ShardName, SpoolLayout, original_name

pytestmark = pytest.mark.slow
LONG_RUN = [
    "model.warm_start=false",
    "trainer.total_steps=100000",  # ended by a cancel once the pool has come and gone
    "trainer.checkpoint_interval_steps=1000",
    "rollout.eval_interval_steps=0",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "observe.audit_sample_ids=true",
    "spool.keep_consumed=true",
]


def scale(run_dir, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "relax_hpc.scale", str(run_dir), *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=submit_env()
    )


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def published_groups(paths: RunPaths, writer: str) -> int:
    status = SpoolLayout(paths.spool_dir).writer_status_path(writer)
    return read_json(status, default={}).get("num_groups", 0)


def heartbeat(paths: RunPaths, worker: str) -> dict:
    return read_json(paths.rollout_assignment_dir / "workers" / f"{worker}.json", default={})


def test_a_pool_joins_survives_a_kill_in_place_drains_and_leaves(tmp_path):
    from relax_hpc.cancel import request_cancel

    run_dir, paths = tmp_path / "run", RunPaths(tmp_path / "run")
    run = subprocess.Popen(
        submit_command(run_dir, *LONG_RUN),
        cwd=REPO,
        env=submit_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(paths.trainer_status, 2, run, timeout_s=600)
        added = scale(run_dir, "add", "1", "--pool", "xtest")
        assert added.returncode == 0, added.stderr
        assert "workers xtest.0" in added.stdout
        wait_until(lambda: published_groups(paths, "rollout.xtest.0") >= 2, 300, "first groups")

        # Killed in place: its keeper restarts it; the trainer never stops.
        first_pid = heartbeat(paths, "xtest.0")["pid"]
        step_at_kill = read_json(paths.trainer_status)["step"]
        os.kill(first_pid, signal.SIGKILL)
        wait_until(lambda: heartbeat(paths, "xtest.0").get("pid") not in (None, first_pid),
                   120, "the restarted worker's heartbeat")  # fmt: skip
        before = published_groups(paths, "rollout.xtest.0")
        wait_until(lambda: published_groups(paths, "rollout.xtest.0") > before, 300, "publishes")
        worker_log = paths.task_log("rollout", "xtest.0").read_text()
        assert "keeper[xtest.0]: worker exited with -9; restart 1 of 3 in place" in worker_log
        assert read_json(paths.trainer_status)["step"] > step_at_kill
        assert run.poll() is None  # no global restart: the run's own tasks never stopped

        status = scale(run_dir, "status")
        assert status.returncode == 0, status.stderr
        rows = {line.split()[0]: line.split() for line in status.stdout.splitlines()[1:]}
        assert rows["xtest.0"][1] == "alive" and rows["r0"][1] == "alive", status.stdout

        drained = scale(run_dir, "drain", "xtest")
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert heartbeat(paths, "xtest.0")["left"] is True
        supervisor = read_json(paths.pool_record("xtest"))["pid"]
        wait_until(lambda: not is_running(supervisor), 60, "the pool supervisor's exit")
        assert "left (exit 0)" in paths.pool_log("xtest").read_text()
        step = read_json(paths.trainer_status)["step"]
        wait_for_step(paths.trainer_status, step + 2, run, timeout_s=300)  # trains on alone
    finally:
        request_cancel(run_dir)
        _, stderr = run.communicate(timeout=300)
    assert "restart 1 of" not in stderr  # the run itself was never restarted

    trained = read_json(paths.consumed_sample_ids)
    ids = [sample for step in trained for sample in step]
    assert not check_exactly_once(set(ids), trained)
    groups = sorted({int(sample.split("/")[0]) for sample in ids})
    assert len(groups) * 4 == len(ids)  # whole groups, each once
    consumed = (paths.spool_dir / "consumed").iterdir()
    writers = {ShardName.parse(original_name(shard.name)).writer_id for shard in consumed}
    assert {"rollout.r0", "rollout.xtest.0"} <= writers, writers  # the pool's groups trained
    refused = scale(run_dir, "add", "1")
    assert refused.returncode == 2 and "is not running" in refused.stderr
