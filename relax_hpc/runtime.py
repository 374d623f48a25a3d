"""Who am I? The identity of one task of a job step, read from the launcher's variables.

The only module that reads Slurm's (or the local executor's) environment. Slurm does not
set ``SLURM_HET_JOB_OFFSET`` for heterogeneous jobs, so nothing here guesses a role from
variables: the role is an argument of the entry point; this module gives rank, world
size and the attempt (job id + restart count) the task belongs to.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

# Set by relax_hpc.launch.local for each task it starts.
LOCAL_PREFIX = "RELAX_HPC_"
# How many starts of its job came before the task's own (local executor, batch script).
START_COUNT_VAR = f"{LOCAL_PREFIX}RESTART_COUNT"
# The CPUs that a bound trainer task's helper processes (its weight-send child) bind to:
# those no trainer task is bound to (``launch/cpu_binding.py``), as "0,1"; unset: unbound.
HELPER_CPUS_VAR = f"{LOCAL_PREFIX}HELPER_CPUS"


def format_cpus(cpus) -> str:
    """CPU numbers as "0,1": as ``HELPER_CPUS_VAR`` holds them and the logs show them."""
    return ",".join(str(cpu) for cpu in sorted(cpus))


def own_cpus() -> str:
    """The CPUs this process may run on (its binding), formatted; "any" where unknown."""
    return format_cpus(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "any"


def helper_cpus(env: Mapping[str, str] | None = None) -> set[int] | None:
    """``HELPER_CPUS_VAR``'s CPUs, or None when it is unset; ValueError when malformed."""
    text = (os.environ if env is None else env).get(HELPER_CPUS_VAR)
    if text is None:
        return None
    try:
        cpus = {int(part) for part in text.split(",")}
    except ValueError:
        cpus = set()
    if not cpus or min(cpus) < 0:
        raise ValueError(f"{HELPER_CPUS_VAR}={text!r} is not a comma list of CPU numbers")
    return cpus


@dataclass(frozen=True)
class TaskIdentity:
    rank: int  # rank within the role's step
    world_size: int  # tasks in the role's step
    local_rank: int  # rank on this node
    job_id: str  # Slurm job id (the hetjob leader's) or "local-<pid of the executor>"
    restart_count: int  # starts of the job before this task's: requeues, trainer restarts
    launcher: str  # slurm | local | none
    # Rollout only: None for the run's own rollout step; else the name of an extra pool of
    # workers added during the run (``relax_hpc.scale``), given on the command line.
    pool: str | None = None

    @property
    def attempt(self) -> str:
        """Distinguishes the processes of one (re)start from those of earlier ones."""
        return f"{self.job_id}.{self.restart_count}"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> TaskIdentity:
        env = os.environ if env is None else env
        if f"{LOCAL_PREFIX}RANK" in env:
            return cls(
                rank=int(env[f"{LOCAL_PREFIX}RANK"]),
                world_size=int(env[f"{LOCAL_PREFIX}WORLD_SIZE"]),
                local_rank=int(env.get(f"{LOCAL_PREFIX}LOCAL_RANK", env[f"{LOCAL_PREFIX}RANK"])),
                job_id=env.get(f"{LOCAL_PREFIX}JOB_ID", "local"),
                restart_count=int(env.get(START_COUNT_VAR, "0")),
                launcher="local",
            )
        if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
            return cls(
                rank=int(env["SLURM_PROCID"]),
                world_size=int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))),
                local_rank=int(env.get("SLURM_LOCALID", "0")),
                job_id=env["SLURM_JOB_ID"],
                # The batch script counts its starts (requeues and the trainer's restarts in
                # place, launch/sbatch.py); Slurm's own count is only the requeues.
                restart_count=int(env.get(START_COUNT_VAR, env.get("SLURM_RESTART_COUNT", "0"))),
                launcher="slurm",
            )
        return cls(0, 1, 0, f"pid{os.getpid()}", 0, "none")


# Set by relax_hpc.launch.local: the supervisor whose death must stop this task.
SUPERVISOR_PID_VAR = f"{LOCAL_PREFIX}SUPERVISOR_PID"
# Set for the rollout worker or judge server that its task's keeper runs
# (launch/keeper.py): that process runs the role itself instead of keeping another.
KEPT_VAR = f"{LOCAL_PREFIX}KEPT"
# The roles whose task is a keeper: a crash or hang restarts them alone, in place.
KEPT_ROLES = ("rollout", "judge")


def stop_when_orphaned(
    env: Mapping[str, str] | None = None, poll_s: float = 1.0
) -> threading.Thread | None:
    """Under the local supervisor, SIGTERM this task once the supervisor is gone.

    Tasks run in sessions of their own (so that a terminal's Ctrl-C reaches only the
    supervisor), so a supervisor killed outright (SIGKILL, the OOM killer) would leave them
    running with nobody to stop them. SIGTERM is the ordinary stop request: the trainer
    checkpoints at its next step boundary, rollout workers publish complete groups only.
    Polls the parent pid (portable; ``prctl`` would be Linux only).
    """
    env = os.environ if env is None else env
    if SUPERVISOR_PID_VAR not in env:
        return None
    supervisor = int(env[SUPERVISOR_PID_VAR])

    def watch() -> None:
        while os.getppid() == supervisor:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="stop-when-orphaned", daemon=True)
    thread.start()
    return thread
