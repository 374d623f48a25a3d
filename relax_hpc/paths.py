"""Every on-disk path of a run directory, in one place, plus the file helpers they share.

The run directory is the only contract between the job's components (trainer and
rollout steps never import each other). Owning all of its paths here keeps the layout
visible and lets a later version move things without hunting through the code. The
inner layouts of ``spool/``, ``rendezvous/`` (weight sync), ``weights/v<N>/`` and of a
checkpoint folder belong to the packages that own those folders. docs/architecture.md
maps who writes and who reads each path (a test keeps it in step with ``RunPaths``).

Helpers: ``atomic_write_*`` (temp name, fsync, rename; ``durable=False`` for advisory files:
no fsync), ``exclusive_create_json`` (claim a name), ``read_json``, ``fsync_file``,
``fsync_dir`` and ``tail_text`` (the last lines of a log).

Durability: a file the run's accounting or a checkpoint depends on (spool shards, ledger,
redo requests, checkpoint markers, the resolved config) is fsynced, and so is the directory
it is renamed into. A status, heartbeat or progress file that is rewritten every step or
every few seconds is *advisory*: a crash that loses its last version loses only what it
said (the next write replaces it, and its readers take a missing or unparsable file as "not
written yet"), so it is renamed into place without an fsync (~0.2 ms of CPU and up to a few
ms of wall time per write saved, on the hot path of both roles). Rename alone still gives
readers the old file or the whole new one while the machine is up; ``close`` before
``rename`` makes the data visible on other NFS clients (close-to-open) and Lustre clients.

Must not: import torch, Hydra, or anything else of ours.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_DIR_ENV = "RELAX_HPC_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$RELAX_HPC_CACHE_DIR``, else ``~/.cache/relax_hpc``: the user's cache, shared by
    runs (warm starts, the installed transformers' class names)."""
    return Path(os.environ.get(CACHE_DIR_ENV, Path.home() / ".cache" / "relax_hpc"))


def _tmp_name(path: Path) -> Path:
    """A temp name beside ``path`` that no other writer (host, process) can collide with."""
    suffix = f".{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    return path.with_name(path.name + suffix)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (after a rename) so that the rename survives a crash."""
    _fsync_path(directory)


def fsync_file(path: Path) -> None:
    """Flush a file written by someone else (h5py, safetensors) before it is renamed."""
    _fsync_path(path)


# A full filesystem, or a quota used up: a state of the run directory, not a crash.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_TEXTS = (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT))


def is_disk_full(err: BaseException) -> bool:
    """``err``, what caused it, or its text (DCP wraps each rank's failure as text) says
    the filesystem is full or the quota is used up."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return any(text in str(err) for text in DISK_FULL_TEXTS)


def _write_new(path: Path, data: bytes, mode: int, flush: bool) -> None:
    """Create ``path`` (it must not exist) holding ``data``; fsync it when ``flush``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if flush:
                os.fsync(handle.fileno())
        os.chmod(path, mode)  # the umask may have narrowed the mode given to open()
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def atomic_write_bytes(
    path: Path | str, data: bytes, mode: int = 0o644, *, durable: bool = True
) -> Path:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one.

    Temp name in the same directory, fsync, chmod, ``os.replace``, fsync of the directory:
    POSIX rename semantics only, which NFS, Lustre and GPFS honour. ``durable=False`` skips
    both fsyncs, for advisory files only (see the module docstring): after a crash the file
    may hold an earlier version, be empty, or be missing.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    _write_new(tmp, data, mode, flush=durable)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def atomic_write_text(
    path: Path | str, text: str, mode: int = 0o644, *, durable: bool = True
) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode, durable=durable)


def atomic_write_json(
    path: Path | str, obj: Any, mode: int = 0o644, *, durable: bool = True
) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    return atomic_write_text(path, text, mode, durable=durable)


def exclusive_create_json(
    path: Path | str, obj: Any, mode: int = 0o644, *, durable: bool = True
) -> bool:
    """Create ``path`` holding ``obj`` unless it exists; True when this call created it.

    Written under a temp name (fsynced) and hard-linked to its final one: ``link`` fails
    when the name exists, atomically on NFS too (``O_EXCL`` is not safe on every NFS), and
    readers never see a partial file, after a crash either: the content is flushed before
    the name exists. The way to claim a name that several processes race for.
    ``durable=False`` flushes nothing: a crash may lose the name, or keep the name with its
    content lost (an empty file: the name's metadata can reach the disk before the data).
    Only for names whose loss costs repeated work, not correctness, and whose readers take
    an unreadable file for one a crash left (the caller says how). While the machine is up
    the content is whole before the name exists either way (written and closed first).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8")
    # The temp name is this call's alone and never read: no rename, no directory flush.
    _write_new(tmp, data, mode, flush=durable)
    try:
        os.link(tmp, path)
        if durable:
            fsync_dir(path.parent)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


_REQUIRED = object()


def read_json(path: Path | str, default: Any = _REQUIRED) -> Any:
    """The JSON document at ``path``. With ``default``: that, when the file is missing or
    not (yet) valid JSON, e.g. a status file before its writer's first update."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, ValueError):
        if default is _REQUIRED:
            raise
        return default


def tail_text(path: Path | str, lines: int) -> str:
    """The last ``lines`` lines of a text file (a log), or a note that there is none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return "(no log)\n"


LOGS_SUBDIR = "logs"
# Held (flock) by the one start running in a run directory, and who holds it (runlock.py).
RUN_LOCK_NAME = "control/run.lock"
RUN_OWNER_NAME = "control/run.owner.json"
WATCH_LOG_NAME = f"{LOGS_SUBDIR}/watch.log"  # the run watcher's output (batch script)
# A step's configuration error; the batch script removes it when a start begins.
CONFIG_ERROR_NAME = "status/config_error.json"
# "<job id> <start>": the batch script's last start, counted over requeues and the
# trainer's restarts in place, so that every start of a job has a number of its own.
JOB_STARTS_NAME = "status/job_starts"


def task_log_name(role: str, task: int | str) -> str:
    """Run-dir-relative log of one task; ``task`` may be Slurm's ``%t`` pattern."""
    return f"{LOGS_SUBDIR}/{role}-{task}.log"


def batch_log_name(job_id: str) -> str:
    """Run-dir-relative log of a Slurm job's batch script; ``job_id`` may be ``%j``."""
    return f"{LOGS_SUBDIR}/batch-{job_id}.log"


BATCH_LOG_NAME = batch_log_name("%j")  # %j: Slurm's job id (the hetjob leader's)


@dataclass(frozen=True)
class RunPaths:
    """The layout of one run directory. Methods only compute paths; ``create`` makes folders."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).resolve())

    # --- configuration and job bookkeeping -------------------------------------------------
    @property
    def resolved_config(self) -> Path:
        """The composed, validated config; requeued and resumed jobs read only this file."""
        return self.root / "config.yaml"

    @property
    def job_plan(self) -> Path:
        return self.root / "job_plan.json"

    @property
    def sbatch_script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def job_file(self) -> Path:
        """Slurm job id and submission facts, written by the submitter."""
        return self.root / "job.json"

    @property
    def submitit_dir(self) -> Path:
        """Where submitit writes the submission file before ``sbatch`` (Slurm only)."""
        return self.root / "submitit"

    @property
    def control_dir(self) -> Path:
        """Operator requests (cancel, drain) as flag files."""
        return self.root / "control"

    def drain_request(self, name: str) -> Path:
        """Present when an operator asked rollout worker or pool ``name`` to finish its
        in-flight groups and leave (``relax_hpc.scale drain``)."""
        return self.control_dir / "drain" / f"{name}"

    def restart_request(self, worker: str) -> Path:
        """Present when rollout worker ``worker``'s keeper is asked to restart it (by an
        operator, or by the run watcher's stall diagnosis, ``observe/stall.py``); the
        keeper removes it when it acts."""
        return self.control_dir / "restart" / f"{worker}"

    @property
    def cancel_request(self) -> Path:
        """Present when an operator asked for a clean stop (``relax_hpc.cancel``)."""
        return self.control_dir / "cancel"

    @property
    def run_lock(self) -> Path:
        """``flock``-ed by the one start running in this directory (``launch/runlock.py``)."""
        return self.root / RUN_LOCK_NAME

    @property
    def run_owner(self) -> Path:
        """Who holds ``run_lock`` (host, pid, Slurm job id)."""
        return self.root / RUN_OWNER_NAME

    @property
    def events_dir(self) -> Path:
        """One JSON file per lifecycle event (started, preempted, ...), read by alerts/status."""
        return self.root / "events"

    @property
    def secrets_dir(self) -> Path:
        """Mode 0700: alert URLs given in the config, kept out of config.yaml and logs."""
        return self.root / "secrets"

    @property
    def alert_urls_file(self) -> Path:
        return self.secrets_dir / "alert_urls"

    def endpoint_token_file(self, name: str) -> Path:
        """Mode 0600: the token of reward endpoint ``name`` when it was given in the config."""
        return self.secrets_dir / f"endpoint-{name}.token"

    @property
    def alert_state(self) -> Path:
        """What the alert rate limiter and the run watcher have already sent."""
        return self.status_dir / "alerts.json"

    @property
    def cost_ledger(self) -> Path:
        """Attempts of the job (start, last seen): elapsed time, restarts and device-hours."""
        return self.status_dir / "cost.json"

    # --- logs and metrics --------------------------------------------------------------------
    @property
    def logs_dir(self) -> Path:
        return self.root / LOGS_SUBDIR

    def task_log(self, role: str, task: int | str) -> Path:
        """Output of one task (rank) of a role's step; Slurm and the local executor agree."""
        return self.root / task_log_name(role, task)

    def batch_log(self, job_id: str) -> Path:
        """The batch script's output: starts, forwarded signals, each step's exit code."""
        return self.root / batch_log_name(job_id)

    @property
    def watch_log(self) -> Path:
        """The run watcher's log (alerts sent, the cost ledger's ticks)."""
        return self.root / WATCH_LOG_NAME

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    @property
    def trainer_tensorboard_dir(self) -> Path:
        return self.tensorboard_dir / "trainer"

    def rollout_tensorboard_dir(self, rank: int | str) -> Path:
        return self.tensorboard_dir / f"rollout-{rank}"

    @property
    def status_dir(self) -> Path:
        """Progress files each component rewrites atomically."""
        return self.root / "status"

    @property
    def trainer_status(self) -> Path:
        """The trainer's last step: step, policy version, metrics, time."""
        return self.status_dir / "trainer.json"

    @property
    def warm_start_status(self) -> Path:
        """The supervised warm start's progress (step, loss) while it trains, before step 1."""
        return self.status_dir / "warm_start.json"

    @property
    def trainer_done(self) -> Path:
        """Written by the trainer after its final checkpoint and export: the run is complete."""
        return self.status_dir / "trainer_done.json"

    @property
    def consumed_sample_ids(self) -> Path:
        """Every trained sample id per step (``observe.audit_sample_ids``), at the end."""
        return self.status_dir / "consumed_sample_ids.json"

    def rollout_status(self, rank: int | str) -> Path:
        """Rollout worker ``rank`` (or an extra pool's worker, by name)'s last batch: metrics, policy version, time."""
        return self.status_dir / f"rollout-{rank}.json"

    @property
    def rollout_assignment_dir(self) -> Path:
        """Which rollout worker generates which prompt groups (``rollout.assignment``)."""
        return self.root / "rollout_assignment"

    def pool_record(self, pool: str) -> Path:
        """An extra rollout pool (``relax_hpc.scale add``): its kind, size, pid or job id."""
        return self.rollout_assignment_dir / "pools" / f"{pool}.json"

    def pool_log(self, pool: str) -> Path:
        """The output of an extra pool's supervisor (local) or batch script (Slurm)."""
        return self.logs_dir / f"pool-{pool}.log"

    def pool_script(self, pool: str) -> Path:
        """The sbatch script an extra pool of a Slurm run was submitted with."""
        return self.root / f"pool-{pool}.sbatch"

    @property
    def eval_history(self) -> Path:
        """Held-out accuracy per evaluated policy version (rollout rank 0)."""
        return self.status_dir / "eval.json"

    # --- data exchange between roles ---------------------------------------------------------
    @property
    def spool_dir(self) -> Path:
        """Sample spool (HDF5 shards); its inner layout belongs to ``relax_hpc.spool``."""
        return self.root / "spool"

    @property
    def rendezvous_dir(self) -> Path:
        """Weight-sync rendezvous files (inner layout: ``relax_hpc.weightsync``), and the
        judge's addresses (``judge/``)."""
        return self.root / "rendezvous"

    @property
    def trainer_group_file(self) -> Path:
        """Rank 0's address for the trainer's own process group, per attempt (mode 0600)."""
        return self.rendezvous_dir / "trainer_group.json"

    @property
    def judge_rendezvous_dir(self) -> Path:
        """One ``<rank>.json`` (0600: address and token) per judge server that is up."""
        return self.rendezvous_dir / "judge"

    def judge_address_file(self, rank: int) -> Path:
        return self.judge_rendezvous_dir / f"{rank}.json"

    def judge_status(self, rank: int) -> Path:
        """What judge server ``rank`` has served (requests, samples, cache hits)."""
        return self.status_dir / f"judge-{rank}.json"

    @property
    def weights_dir(self) -> Path:
        """Filesystem export of policy weights, one folder per policy version."""
        return self.root / "weights"

    def weights_version_dir(self, policy_version: int) -> Path:
        return self.weights_dir / f"v{policy_version}"

    # --- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_dir / f"step_{step:08d}"

    @property
    def export_dir(self) -> Path:
        """Default destination of the Hugging Face export at the end of a run."""
        return self.root / "export"

    @property
    def miniature_data_dir(self) -> Path:
        """A miniature run's few rows of data, in the recipe's schema (``relax_hpc.miniature``)."""
        return self.root / "miniature"

    @property
    def component_failure(self) -> Path:
        """Written by a rollout task's keeper that gave up restarting its worker
        (``rollout.max_restarts``): this start ends as failed, not requeued."""
        return self.status_dir / "component_failed.json"

    @property
    def job_starts(self) -> Path:
        return self.root / JOB_STARTS_NAME

    @property
    def config_error(self) -> Path:
        """Written by a component that exits with a configuration error: no restart helps."""
        return self.root / CONFIG_ERROR_NAME

    @property
    def task_errors_dir(self) -> Path:
        """What ended each task of the latest start (``component.record_task_error``)."""
        return self.status_dir / "errors"

    def task_error(self, role: str, rank: int | str) -> Path:
        """The error that ended task ``rank`` of ``role``; the task removes it when it starts."""
        return self.task_errors_dir / f"{role}-{rank}.json"

    @property
    def start_failure(self) -> Path:
        """The error that ended the last start, and the trainer's step then (``launch/outcome``)."""
        return self.status_dir / "start_failure.json"

    def create(self) -> RunPaths:
        for folder in (
            self.root,
            self.control_dir,
            self.events_dir,
            self.logs_dir,
            self.tensorboard_dir,
            self.status_dir,
            self.spool_dir,
            self.rendezvous_dir,
            self.weights_dir,
            self.checkpoints_dir,
            self.secrets_dir,
        ):
            folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.rendezvous_dir, 0o700)  # holds the per-run weight-sync token
        os.chmod(self.secrets_dir, 0o700)  # holds alert URLs (passwords, webhook tokens)
        return self
