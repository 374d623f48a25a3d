"""A rollout worker that crashes at every start: bounded restarts, then one clear failure.

The run's own worker dies as it starts, every time (``crashing_worker``). Its keeper
restarts it ``rollout.max_restarts`` times with backoff, then gives up: the run ends as
failed at once (no requeue of the job, no endless loop), the failure names the worker and
its last error, and a ``failed`` alert carries the same line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2e_helpers import failure_report, submit

from relax_hpc.observe.events import read_events
from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
LAST_ERROR = "fatal: no usable device for the engine on this node (crashing_worker)"


def test_a_worker_crashing_at_every_start_ends_the_run_with_its_error_and_an_alert(
    tmp_path, webhook_sink
):
    run_dir = tmp_path / "run"
    user_env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    result = submit(
        run_dir,
        "rollout.reward=crashing_worker:exact_match",
        "rollout.max_restarts=2",
        "rollout.restart_backoff_s=0.5",
        "cluster.max_restarts=3",
        "model.warm_start=false",
        "observe.alerts.poll_s=0.5",
        f"observe.alerts.urls=['{webhook_sink.url}']",
        env=user_env,
        timeout_s=600,
    )
    assert result.returncode == 1, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    line = "rollout worker r0 exited with 1 after 2 restart(s) in place"
    assert f"{line} (rollout.max_restarts=2); last error: {LAST_ERROR}" in result.stderr
    assert "restart 1 of 3" not in result.stderr  # the job itself was not restarted
    log = paths.task_log("rollout", 0).read_text()
    assert log.count("worker started (pid") == 3 and "restart 2 of 2 in place" in log
    ((_, gave_up),) = read_events(paths, "component_gave_up")
    assert gave_up["component"] == "rollout/r0" and gave_up["last_error"] == LAST_ERROR
    failed = [body for _, body in webhook_sink.posts if "FAILED" in body.get("title", "")]
    assert len(failed) == 1 and LAST_ERROR in failed[0]["message"], webhook_sink.titles()
