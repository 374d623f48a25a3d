"""A run directory on a filesystem that fills up: one clear line and an alert, no restart
loop, no traceback from the supervisor; freed, the same command resumes and trains every
sample once (issue #34 item 10).

The filesystem is a real one of a few MB: a tmpfs the test mounts (root only).
"""

from __future__ import annotations

import os
import subprocess

import pytest
from e2e_helpers import failure_report, submit

from relax_hpc.paths import RunPaths, read_json

pytestmark = pytest.mark.slow

SHORT_RUN = (
    "model.warm_start=false",
    "trainer.total_steps=12",
    "trainer.checkpoint_interval_steps=2",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "data.eval_size=2",
    "observe.audit_sample_ids=true",
    "observe.alerts.poll_s=0.5",
)


@pytest.fixture
def small_filesystem(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)])
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_filesystem_is_named_once_and_the_run_resumes_when_freed(
    small_filesystem, webhook_sink
):
    run_dir = small_filesystem / "run"
    hook = f"observe.alerts.urls=['{webhook_sink.url}']"
    full = submit(run_dir, *SHORT_RUN, hook, "cluster.max_restarts=3", timeout_s=600)
    assert full.returncode == 1, failure_report(full, run_dir)
    line = "the run directory's filesystem is full"
    assert line in full.stderr and f"resume with run_dir={run_dir}" in full.stderr
    assert "restart 1 of" not in full.stderr  # no restart loop
    assert "Exception in thread" not in full.stderr and "observe/cost.py" not in full.stderr
    assert any(line in body.get("message", "") for _, body in webhook_sink.posts), [
        body.get("title") for _, body in webhook_sink.posts
    ]

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_filesystem)], check=True)
    resumed = submit(run_dir, *SHORT_RUN, hook, timeout_s=600)
    assert resumed.returncode == 0, failure_report(resumed, run_dir)
    paths = RunPaths(run_dir)
    assert read_json(paths.trainer_done)["step"] == 12
    steps = read_json(paths.consumed_sample_ids)  # the steps the final checkpoint holds
    ids = [sample for step in steps for sample in step]
    assert len(steps) == 12 and len(ids) == len(set(ids)) == 12 * 16  # each trained once
