"""The batch script restarts a crashed trainer's step alone, bounded by cluster.max_restarts.

The rendered script runs under bash with Slurm faked at the subprocess boundary: ``srun``
runs its command (output to the step's log), ``scontrol`` records what it was asked. The
steps are small python scripts: a trainer that crashes (SIGKILL) a given number of starts
before it finishes, and a rollout step that records its pid and runs until the trainer is
done or it is asked to stop. The real cluster test is tests/slurm/test_slurm_trainer_restart.py.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc import exitcodes
from relax_hpc.launch.outcome import decide_end, restarts_trainer_alone, trainer_crashed
from relax_hpc.launch.plan import build_job_plan
from relax_hpc.launch.sbatch import render_sbatch
from relax_hpc.observe.events import read_events
from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.skipif(shutil.which("flock") is None, reason="needs bash and flock")

FAKE_SRUN = """#!/bin/bash
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do
  case "$1" in --output=*) out="${1#--output=}" ;; esac
  shift
done
exec "$@" >>"${out//%t/0}" 2>&1
"""
FAKE_SCONTROL = '#!/bin/bash\necho "$@" >>"$FAKE_SLURM_CALLS"\n'
TRAINER = """
import os, signal, sys, pathlib
run = pathlib.Path(sys.argv[1])
start = int(os.environ["RELAX_HPC_RESTART_COUNT"])
with open(run / "trainer_starts", "a") as f:
    f.write(f"{start}\\n")
if start < int(sys.argv[2]):
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no warning, no exit code of its own
(run / "status" / "trainer_done.json").write_text("{}")
"""
ROLLOUT = """
import os, signal, sys, time, pathlib
run = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
with open(run / "rollout_pids", "a") as f:
    f.write(f"{os.getpid()}\\n")
while not (run / "status" / "trainer_done.json").exists():
    time.sleep(0.1)
"""


def fake_job(tmp_path: Path, crashes: int, max_restarts: int) -> tuple[RunPaths, Path, dict]:
    """A rendered grpo_tiny hetjob whose trainer crashes ``crashes`` times; script, env."""
    from relax_hpc.config.compose import compose_run_config

    paths = RunPaths(tmp_path / "run").create()
    cfg = compose_run_config(
        ["+experiment=grpo_tiny", "cluster=slurm", f"cluster.max_restarts={max_restarts}"]
    )
    plan = build_job_plan(cfg, str(paths.root))
    scripts = {}
    for role, text in (("trainer", TRAINER), ("rollout", ROLLOUT)):
        scripts[role] = tmp_path / f"{role}.py"
        scripts[role].write_text(text)
    commands = {
        "trainer": (sys.executable, str(scripts["trainer"]), str(paths.root), str(crashes)),
        "rollout": (sys.executable, str(scripts["rollout"]), str(paths.root)),
    }
    roles = tuple(dataclasses.replace(r, command=commands[r.role]) for r in plan.roles)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(dataclasses.replace(plan, roles=roles)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "FAKE_SLURM_CALLS": str(tmp_path / "scontrol_calls"),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    env.pop("SLURM_RESTART_COUNT", None)
    return paths, script, env


def run_job(script: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=240
    )


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_a_crashed_trainer_step_restarts_alone_and_the_rollout_step_keeps_running(tmp_path):
    paths, script, env = fake_job(tmp_path, crashes=2, max_restarts=3)
    job = run_job(script, env)
    log = job.stdout + job.stderr
    assert job.returncode == 0, log
    assert lines(paths.root / "trainer_starts") == ["0", "1", "2"]
    assert len(lines(paths.root / "rollout_pids")) == 1, log  # one rollout process throughout
    assert "restart 1 of 3 from the last complete checkpoint: the trainer alone" in log
    assert "restart 2 of 3 from the last complete checkpoint: the trainer alone" in log
    assert "finished: training complete" in log
    assert not (tmp_path / "scontrol_calls").exists()  # never requeued
    assert paths.job_starts.read_text().split() == ["42", "2"]
    events = [record for _, record in read_events(paths, "trainer_restarted")]
    assert [event["restarts"] for event in events] == [1, 2], log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(paths.tensorboard_dir / "recovery"))
    board.Reload()
    assert [s.value for s in board.Scalars("recovery/trainer_restarts")] == [1, 2]


def test_once_the_restarts_are_spent_the_job_fails_without_a_requeue(tmp_path):
    paths, script, env = fake_job(tmp_path, crashes=5, max_restarts=1)
    job = run_job(script, env)
    log = job.stdout + job.stderr
    assert job.returncode == exitcodes.FAILED, log
    assert lines(paths.root / "trainer_starts") == ["0", "1"]
    assert "gave up after 1 restart(s) (cluster.max_restarts=1)" in log
    assert "rollout step exited with 0" in log  # asked to stop (USR1) once the start ended
    assert not (tmp_path / "scontrol_calls").exists()


def test_a_requeue_after_restarts_in_place_gets_the_next_start_number(tmp_path):
    """A start after the trainer's restarts in place counts them: a number of its own for
    its task records and weight-sync attempts, and the same cluster.max_restarts."""
    paths, script, env = fake_job(tmp_path, crashes=0, max_restarts=3)
    paths.job_starts.write_text("42 2\n")  # this job's last start so far: 2 (one requeue)
    job = run_job(script, {**env, "SLURM_RESTART_COUNT": "1"})
    assert job.returncode == 0, job.stdout + job.stderr
    assert lines(paths.root / "trainer_starts") == ["3"]
    assert "start 4 of this job" in job.stdout
    paths.job_starts.write_text("41 7\n")  # another job's: not counted
    assert run_job(script, {**env, "SLURM_RESTART_COUNT": "1"}).returncode == 0
    assert lines(paths.root / "trainer_starts")[-1] == "1"


@pytest.mark.parametrize(
    ("trainer_exit", "others_running", "signal", "alone"),
    [
        (-9, True, None, True),
        (137, True, None, True),
        (1, False, None, False),  # another step ended too: the whole job starts again
        (-9, True, "SIGUSR1", False),  # a stop was asked for: requeue with a checkpoint
        (exitcodes.STOPPED, True, None, False),
        (exitcodes.CONFIG_ERROR, True, None, False),
    ],
)
def test_which_trainer_ends_restart_it_alone(trainer_exit, others_running, signal, alone):
    end = decide_end(
        trainer_exit,
        trainer_done=False,
        config_error=None,
        cancelled_by=None,
        signal=signal,
        restarts=0,
        max_restarts=3,
    )
    assert (
        restarts_trainer_alone(end, trainer_exit, others_running=others_running, signal=signal)
        is alone
    )
    assert trainer_crashed(trainer_exit) is (trainer_exit not in (0, 2, 75))
