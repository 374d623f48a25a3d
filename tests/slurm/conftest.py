"""Every test here runs against the real local Slurm cluster (scripts/slurm_local.sh).

Without one they are skipped with the command that starts it; under CI (CI=true, where
scripts/test.sh starts the cluster) a missing cluster is a failure, never a silent skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

COMMAND_TIMEOUT_S = 15


def cluster_unavailable_reason() -> str | None:
    conf_path = os.environ.get("SLURM_CONF")
    if not conf_path:
        return (
            "SLURM_CONF is not set: start the local cluster with `scripts/slurm_local.sh start` "
            'and `eval "$(scripts/slurm_local.sh env)"`'
        )
    if shutil.which("sinfo") is None:
        return "sinfo is not installed: run `scripts/slurm_local.sh start`"
    try:
        subprocess.run(["sinfo", "-h"], check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    except (subprocess.SubprocessError, OSError) as error:
        return f"sinfo does not answer with SLURM_CONF={conf_path}: {error}"
    return None


@pytest.fixture(scope="module", autouse=True)
def _require_cluster() -> None:
    reason = cluster_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true" and os.environ.get("RELAX_HPC_SKIP_SLURM") != "1":
        pytest.fail(f"CI needs the local Slurm cluster: {reason}")
    pytest.skip(reason)
