"""One job at a time per run directory: the lock a start holds, real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc import exitcodes, submit
from relax_hpc.launch.runlock import RunInUse, hold_run_lock, lock_holder, refuse_if_in_use
from relax_hpc.paths import RunPaths

HOLDER = """
import sys, time
from relax_hpc.launch.runlock import hold_run_lock
from relax_hpc.paths import RunPaths
with hold_run_lock(RunPaths(sys.argv[1]), wait_s=0):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def held(tmp_path):
    """Another process holding the run directory's lock, as a running start does."""
    run_dir = tmp_path / "run"
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    yield RunPaths(run_dir), holder
    holder.kill()
    holder.wait(timeout=30)


def test_a_held_run_is_named_and_refused_until_its_holder_dies(held):
    paths, holder = held
    assert f"a local run (pid {holder.pid} on " in lock_holder(paths)
    with pytest.raises(RunInUse) as err, hold_run_lock(paths, wait_s=0.5):
        pytest.fail("a second holder got the lock")
    assert "relax_hpc.cancel" in str(err.value) and str(paths.root) in str(err.value)
    with pytest.raises(RunInUse):
        refuse_if_in_use(paths)
    holder.send_signal(signal.SIGKILL)  # no clean-up: the kernel releases the lock
    holder.wait(timeout=30)
    assert lock_holder(paths) is None
    with hold_run_lock(paths, wait_s=0):
        assert f"a local run (pid {os.getpid()} on " in lock_holder_from_child(paths)


def lock_holder_from_child(paths: RunPaths) -> str:
    """``lock_holder`` as another process sees it (a process's own flock never blocks it)."""
    code = "import sys; from relax_hpc.launch.runlock import lock_holder; from relax_hpc.paths "
    code += "import RunPaths; print(lock_holder(RunPaths(sys.argv[1])))"
    result = subprocess.run(
        [sys.executable, "-c", code, str(paths.root)], capture_output=True, text=True, timeout=60
    )
    return result.stdout.strip()


def test_submit_refuses_a_run_directory_in_use_and_rewrites_nothing(held, capsys):
    paths, holder = held
    before = {p: p.stat().st_mtime_ns for p in (paths.sbatch_script, paths.job_plan)}
    argv = ["+experiment=grpo_tiny", f"run_dir={paths.root}", "cluster=local"]
    assert submit.run(argv) == exitcodes.RUN_IN_USE
    assert f"is in use by a local run (pid {holder.pid}" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in before} == before
    assert not list(Path(paths.logs_dir).glob("trainer-*.log"))  # nothing started
