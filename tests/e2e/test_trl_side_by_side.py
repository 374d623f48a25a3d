"""benchmarks/trl_side_by_side.py in miniature (2 steps per engine), so it never rots: TRL's
GRPOTrainer, relax_hpc async and sync in one run, and a report with every figure. No
timing is asserted (2 shared cores): only that each figure is there and makes sense."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from e2e_helpers import REPO, submit_env

FIGURES = {
    "samples_per_s",
    "s_per_step",
    "cpu_s_per_sample",
    "cpu_s_by_process",
    "final_accuracy",
    "start_accuracy",
    "steps_timed",
    "samples_timed",
    "generate_step_s",
    "train_step_s",
    "overlap",
    "cores_busy_by_process",
}
RATIOS = {"ratio_samples_per_s", "ratio_s_per_step", "ratio_cpu_s_per_sample"}

pytestmark = pytest.mark.slow  # three runs and TRL: 1-3 min on 2 loaded cores


def test_side_by_side_reports_every_figure(tmp_path):
    report_path = tmp_path / "report.json"
    command = [
        sys.executable,
        "benchmarks/trl_side_by_side.py",
        "--steps",
        "2",
        "--json",
        str(report_path),
    ]
    result = subprocess.run(
        command, cwd=REPO, env=submit_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    engines = report["engines"]
    assert set(engines) == {"trl", "async", "sync"}
    for key, figures in engines.items():
        expected = FIGURES if key == "trl" else FIGURES | RATIOS
        assert set(figures) == expected, key
        assert figures["steps_timed"] == 1 and figures["samples_timed"] == 16 * 8
        for name in ("samples_per_s", "s_per_step", "cpu_s_per_sample"):
            assert math.isfinite(figures[name]) and figures[name] > 0, (key, name)
        assert 0.0 <= figures["final_accuracy"] <= 1.0
    assert engines["trl"]["overlap"] is None
    assert engines["async"]["overlap"] > 0
    # every process of a relax_hpc run is counted, each under its role
    processes = set(engines["async"]["cpu_s_by_process"])
    assert {"supervisor", "trainer", "keeper", "rollout"} <= processes, processes
    assert "TRL" in engines["trl"]["cpu_s_by_process"]
    for key, figures in engines.items():  # cores busy: the same processes, CPU over wall
        busy, cpu = figures["cores_busy_by_process"], figures["cpu_s_by_process"]
        assert set(busy) == set(cpu), key
        wall_s = figures["s_per_step"] * figures["steps_timed"]
        for name, share in busy.items():
            assert share == pytest.approx(cpu[name] / wall_s), (key, name)
    assert "cores busy (CPU s / wall s of the timed steps): " in result.stdout
    assert "relax_hpc async: samples/s" in result.stdout
