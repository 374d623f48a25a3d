"""Every on-disk path of a run directory, in one place, plus the atomic-write helpers.

The run directory is the only contract between the job's components (trainer and
rollout steps never import each other). Owning all of its paths here keeps the layout
visible and lets a later version move things without hunting through the code.

Must not: import torch, Hydra, or anything else of ours.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _tmp_name(path: Path) -> Path:
    """A temp name beside ``path`` that no other writer (host, process) can collide with."""
    suffix = f".{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    return path.with_name(path.name + suffix)


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (after a rename) so that the rename survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to ``path`` so that readers see either the old file or the whole new one.

    Temp name in the same directory, fsync, chmod, ``os.replace``, fsync of the directory:
    POSIX rename semantics only, which NFS, Lustre and GPFS honour.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)  # the umask may have narrowed the mode given to open()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: Path | str, text: str, mode: int = 0o644) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path | str, obj: Any, mode: int = 0o644) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n", mode)


def read_json(path: Path | str) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


LOGS_SUBDIR = "logs"
CANCEL_REQUEST_NAME = "control/cancel"  # run-dir-relative; the batch script checks it too
# Held (flock) by the one start running in a run directory, and who holds it (runlock.py).
RUN_LOCK_NAME = "control/run.lock"
RUN_OWNER_NAME = "control/run.owner.json"
# Written by the trainer after its final checkpoint and export: the run is complete.
TRAINER_DONE_NAME = "status/trainer_done.json"
CONFIG_ERROR_NAME = "status/config_error.json"  # run-dir-relative; the batch script checks it
BATCH_LOG_NAME = f"{LOGS_SUBDIR}/batch-%j.log"  # %j: Slurm's job id (the hetjob leader's)


def task_log_name(role: str, task: int | str) -> str:
    """Run-dir-relative log of one task; ``task`` may be Slurm's ``%t`` pattern."""
    return f"{LOGS_SUBDIR}/{role}-{task}.log"


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
    def control_dir(self) -> Path:
        """Operator requests (cancel, drain) as flag files."""
        return self.root / "control"

    @property
    def cancel_request(self) -> Path:
        """Present when an operator asked for a clean stop (``relax_hpc.cancel``)."""
        return self.root / CANCEL_REQUEST_NAME

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

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    @property
    def trainer_done(self) -> Path:
        return self.root / TRAINER_DONE_NAME

    @property
    def status_dir(self) -> Path:
        """Heartbeats and progress files each component rewrites atomically."""
        return self.root / "status"

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
    def config_error(self) -> Path:
        """Written by a component that exits with a configuration error: no restart helps."""
        return self.root / CONFIG_ERROR_NAME

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
