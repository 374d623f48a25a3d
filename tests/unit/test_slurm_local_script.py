"""scripts/slurm_local.sh parses and answers its command line (no cluster, no packages needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"
MAIN_SCRIPT = SCRIPTS_DIR / "slurm_local.sh"
SHELL_FILES = [MAIN_SCRIPT, *sorted((SCRIPTS_DIR / "slurm_local").glob("*.sh"))]


def _run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(MAIN_SCRIPT), *args], capture_output=True, text=True, timeout=30
    )


def test_helper_scripts_exist() -> None:
    names = {path.name for path in SHELL_FILES}

    assert {"slurm_local.sh", "lib.sh", "conf.sh", "accounting.sh", "kicker.sh"} <= names


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda path: path.name)
def test_shell_syntax(path: Path) -> None:
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)

    assert checked.returncode == 0, checked.stderr


def test_help_prints_usage_and_exits_0() -> None:
    shown = _run_script("--help")

    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("usage: scripts/slurm_local.sh")
    for command in ("start", "stop", "status", "env", "verify"):
        assert f"  {command} " in shown.stdout


def test_unknown_command_fails_with_a_message() -> None:
    shown = _run_script("launch-the-rockets")

    assert shown.returncode != 0
    assert "unknown command 'launch-the-rockets'" in shown.stderr


def test_bad_knob_is_named(tmp_path: Path) -> None:
    shown = subprocess.run(
        ["bash", str(MAIN_SCRIPT), "env", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", "SLURM_LOCAL_NODES": "four"},
    )

    assert shown.returncode != 0
    assert "SLURM_LOCAL_NODES=four" in shown.stderr


def test_env_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    shown = _run_script("env", str(tmp_path / "no-cluster-here"))

    assert shown.returncode != 0
    assert "slurm_local.sh start" in shown.stderr
