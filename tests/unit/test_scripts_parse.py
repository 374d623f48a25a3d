"""Every shell script under scripts/ parses (``bash -n``): the GPU ones cannot run here, so a
syntax slip in them would otherwise first show on a cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "scripts").glob("*.sh"))


def test_the_gpu_scripts_are_among_them():
    assert {"gpu_check.sh", "test_gpu.sh"} <= {script.name for script in SCRIPTS}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.name)
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
