"""Which launcher a run uses: ``cluster.kind`` = local | slurm | auto."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

SINFO_TIMEOUT_S = 10


def slurm_answers(run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> bool:
    """True when ``sinfo`` exists and a controller answers it."""
    if shutil.which("sinfo") is None:
        return False
    try:
        result = run(
            ["sinfo", "--noheader", "--format=%P"],
            capture_output=True,
            text=True,
            timeout=SINFO_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def resolve_cluster_kind(kind: str, probe: Callable[[], bool] = slurm_answers) -> tuple[str, str]:
    """(kind, reason); ``auto`` becomes slurm when ``sinfo`` answers, else local."""
    if kind != "auto":
        return kind, f"cluster={kind} (from the config)"
    if probe():
        return "slurm", "cluster=auto chose slurm: sinfo answered"
    return "local", "cluster=auto chose local: no Slurm controller answered sinfo"
