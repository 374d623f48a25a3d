"""One job at a time per run directory.

Two jobs on one run directory would claim from the same spool, overwrite each other's
shards and checkpoints and train samples twice. So every start holds an exclusive
``flock`` on ``control/run.lock`` for as long as it runs: the batch script of a Slurm job
(``flock`` from util-linux, see sbatch.py) and the local supervisor (here). ``submit``
refuses a run directory whose lock is held, or whose recorded Slurm job is still queued
(a pending job does not hold the lock yet).

The lock is released by the kernel when its holder dies, so a crashed start never leaves
it behind. On NFS the server releases a dead client's lock only after its lease (about 90 s),
so a start waits for the lock (``cluster.run_lock_wait_s``) before giving up. On a
filesystem without ``flock`` support (Lustre mounted without ``flock``) the guard is off
and a warning says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

from relax_hpc.paths import RunPaths, atomic_write_json, read_json

# flock(2) errors that mean "this filesystem cannot lock", not "someone holds it".
UNSUPPORTED = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}
LIVE_SLURM_STATES = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SUSPENDED",
    "CONFIGURING",
    "COMPLETING",
    "RESIZING",
    "STOPPED",
    "SIGNALING",
)


class RunInUse(RuntimeError):
    """Another job holds (or will hold) this run directory."""


def owner_description(paths: RunPaths) -> str:
    """Who holds the lock, from ``control/run.owner.json`` (written by the holder)."""
    owner = read_json(paths.run_owner, default=None)
    if not isinstance(owner, dict):
        return "another job"
    job = f"Slurm job {owner['job_id']}" if owner.get("job_id") else "a local run"
    return f"{job} (pid {owner.get('pid')} on {owner.get('host')})"


def _try_lock(fd: int) -> bool | None:
    """True: locked; False: held by someone else; None: this filesystem cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in UNSUPPORTED:
            return None
        raise


def _open_lock(paths: RunPaths) -> int:
    paths.control_dir.mkdir(parents=True, exist_ok=True)
    return os.open(paths.run_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def lock_holder(paths: RunPaths) -> str | None:
    """A description of the start holding the run's lock; None when it is free (or when the
    filesystem cannot tell)."""
    if not paths.run_lock.exists():
        return None
    fd = _open_lock(paths)
    try:
        return owner_description(paths) if _try_lock(fd) is False else None
    finally:
        os.close(fd)  # closing releases a lock taken just to look


@contextlib.contextmanager
def hold_run_lock(paths: RunPaths, wait_s: float, poll_s: float = 0.5) -> Iterator[int | None]:
    """Hold the run's lock while the body runs; ``RunInUse`` after ``wait_s`` without it.

    Yields the locked descriptor (None where the filesystem cannot lock): children that
    inherit it keep the lock held until they end too."""
    fd = _open_lock(paths)
    try:
        deadline = time.monotonic() + wait_s
        while (locked := _try_lock(fd)) is False and time.monotonic() < deadline:
            time.sleep(poll_s)
        if locked is False:
            raise RunInUse(_in_use_message(paths, owner_description(paths)))
        if locked is None:
            print(
                f"relax_hpc: {paths.root} cannot be locked (no flock on this "
                "filesystem); not guarding against a second job",
                file=sys.stderr,
            )
        else:
            record_owner(paths)
        yield fd if locked else None
    finally:
        os.close(fd)


def record_owner(paths: RunPaths) -> None:
    """This local supervisor as the holder (the batch script writes a Slurm job's record)."""
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "job_id": None, "since": time.time()}
    atomic_write_json(paths.run_owner, owner)


def queued_slurm_job(paths: RunPaths) -> tuple[str, str] | None:
    """(job id, state) of the run's recorded Slurm job while Slurm still has it queued or
    running; None when there is none, it ended, or ``squeue`` cannot be asked."""
    if not paths.job_file.is_file():
        return None
    job_id = str(read_json(paths.job_file).get("job_id", ""))
    try:
        result = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    states = [s for s in result.stdout.split() if s in LIVE_SLURM_STATES]
    return (job_id, states[0]) if result.returncode == 0 and states else None


def refuse_if_in_use(paths: RunPaths) -> None:
    """``RunInUse`` when a start holds the run directory or its Slurm job is still queued."""
    holder = lock_holder(paths)
    if holder is None and (queued := queued_slurm_job(paths)) is not None:
        holder = f"Slurm job {queued[0]} ({queued[1]})"
    if holder is not None:
        raise RunInUse(_in_use_message(paths, holder))


def _in_use_message(paths: RunPaths, holder: str) -> str:
    return (
        f"{paths.root} is in use by {holder}; a second job would train its samples twice. "
        f"Watch it with `python -m relax_hpc.status {paths.root}`, stop it with "
        f"`python -m relax_hpc.cancel {paths.root}`, or submit with a new run_dir="
    )
