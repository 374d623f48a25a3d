"""The local Slurm cluster of scripts/slurm_local.sh gives relax_hpc what it relies on.

Checked against the running cluster: at least 4 virtual nodes and the partitions debug and hi;
a 2-component hetjob whose components run on different nodes, see SLURM_JOB_ID_HET_GROUP_1 but
no SLURM_HET_JOB_OFFSET (Slurm 22.05 never sets it), and show up in sacct as <id>+0 and <id>+1;
a running --requeue job that `scontrol requeue` restarts with SLURM_RESTART_COUNT=1.

Skipped unless SLURM_CONF is set and sinfo answers. About 15 s on an idle cluster; every wait
has a deadline.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

COMMAND_TIMEOUT_S = 15
JOB_TIMEOUT_S = 20
SACCT_TIMEOUT_S = 10  # slurmctld sends job records to slurmdbd asynchronously
# A requeued job is eligible again cred_expire + 1 s after the requeue (7 s measured with the
# script's default cred_expire=5; up to 2 s more for the scheduler pass).
REQUEUE_TIMEOUT_S = 25
POLL_S = 0.25
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

# Runs as each hetjob step: one key=value per line. `${VAR-unset}` tells unset from empty.
STEP_REPORT_SH = """#!/bin/bash
echo "node=$SLURMD_NODENAME"
echo "het_group_1_job_id=${SLURM_JOB_ID_HET_GROUP_1:-}"
echo "het_job_offset=${SLURM_HET_JOB_OFFSET-unset}"
"""

# First run waits to be requeued; the restarted run reports its restart count and ends.
REQUEUE_JOB_SH = """#!/bin/bash
#SBATCH --job-name=relax-requeue-test
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={output_path}
echo "run restart_count=${{SLURM_RESTART_COUNT:-unset}}"
if [ -z "${{SLURM_RESTART_COUNT:-}}" ]; then sleep 30; fi
"""

HETJOB_SH = """#!/bin/bash
#SBATCH --job-name=relax-hetjob-test
#SBATCH --output={work_dir}/batch.out
#SBATCH -n 1 -c 1
#SBATCH hetjob
#SBATCH -n 1 -c 1
srun --het-group=0 --output={work_dir}/step0.out bash {work_dir}/report.sh &
srun --het-group=1 --output={work_dir}/step1.out bash {work_dir}/report.sh &
wait
"""


def _run(args: list[str]) -> str:
    return subprocess.run(
        args, check=True, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    ).stdout


def _wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def _submit(script_path: Path) -> str:
    # --parsable prints "<id>" or "<id>;<cluster>"
    return _run(["sbatch", "--parsable", str(script_path)]).strip().split(";")[0]


def _job_states(job_id: str) -> list[str]:
    """JobState of every component (a hetjob lists one record per component)."""
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    return re.findall(r"\bJobState=(\S+)", shown.stdout)


def _is_finished(job_id: str) -> bool:
    states = _job_states(job_id)
    return bool(states) and all(state in FINAL_STATES for state in states)


def _read_report(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines() if path.exists() else []
    return dict(line.split("=", 1) for line in lines if "=" in line)


def _sacct_states(job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", job_id],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    rows = (line.split("|", 1) for line in shown.stdout.splitlines() if "|" in line)
    return {row_id: state for row_id, state in rows}


def _sacct_enabled() -> bool:
    shown = subprocess.run(
        ["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )
    return "accounting storage is disabled" not in shown.stderr + shown.stdout


@dataclass(frozen=True)
class HetjobRun:
    job_id: str
    states: list[str]
    step_reports: list[dict[str, str]]


@pytest.fixture(scope="module")
def hetjob_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HetjobRun]:
    """One 2-component hetjob, run to the end; each component runs the step report."""
    work_dir = tmp_path_factory.mktemp("hetjob")
    (work_dir / "report.sh").write_text(STEP_REPORT_SH)
    script_path = work_dir / "hetjob.sh"
    script_path.write_text(HETJOB_SH.format(work_dir=work_dir))
    job_id = _submit(script_path)
    try:
        finished = _wait_until(lambda: _is_finished(job_id), JOB_TIMEOUT_S)
        assert finished, (
            f"hetjob {job_id} not finished after {JOB_TIMEOUT_S} s: {_job_states(job_id)}"
        )
        reports = [_read_report(work_dir / f"step{group}.out") for group in (0, 1)]
        yield HetjobRun(job_id=job_id, states=_job_states(job_id), step_reports=reports)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=COMMAND_TIMEOUT_S)


def test_cluster_has_four_nodes_and_both_partitions() -> None:
    node_names = set(_run(["sinfo", "-h", "-N", "-o", "%N"]).split())
    partitions = set(_run(["sinfo", "-h", "-o", "%R"]).split())

    assert len(node_names) >= 4, f"a 4-component hetjob needs 4 nodes, got {sorted(node_names)}"
    assert {"debug", "hi"} <= partitions


def test_hetjob_components_run_on_different_nodes(hetjob_run: HetjobRun) -> None:
    nodes = [report.get("node") for report in hetjob_run.step_reports]

    assert hetjob_run.states == ["COMPLETED", "COMPLETED"]
    assert all(nodes), f"a step did not report its node: {hetjob_run.step_reports}"
    assert nodes[0] != nodes[1]


def test_hetjob_environment_names_groups_but_no_offset(hetjob_run: HetjobRun) -> None:
    for report in hetjob_run.step_reports:
        assert report.get("het_group_1_job_id", "").isdigit(), report
        assert report.get("het_job_offset") == "unset", report


def test_hetjob_components_are_in_sacct(hetjob_run: HetjobRun) -> None:
    if not _sacct_enabled():
        pytest.skip("accounting is off (SLURM_LOCAL_ACCOUNTING=none): sacct has no records")
    job_id = hetjob_run.job_id
    expected = {f"{job_id}+0": "COMPLETED", f"{job_id}+1": "COMPLETED"}

    recorded = _wait_until(lambda: _sacct_states(job_id) == expected, SACCT_TIMEOUT_S)

    assert recorded, f"sacct after {SACCT_TIMEOUT_S} s: {_sacct_states(job_id)}, want {expected}"


def test_requeued_job_restarts_with_restart_count_1(tmp_path: Path) -> None:
    output_path = tmp_path / "requeue.out"
    script_path = tmp_path / "requeue.sh"
    script_path.write_text(REQUEUE_JOB_SH.format(output_path=output_path))
    job_id = _submit(script_path)

    def output_lines() -> list[str]:
        # Only the job's own lines: slurmstepd also logs "CANCELLED ... DUE TO JOB REQUEUE".
        lines = output_path.read_text().splitlines() if output_path.exists() else []
        return [line for line in lines if line.startswith("run ")]

    try:
        started = _wait_until(lambda: "run restart_count=unset" in output_lines(), JOB_TIMEOUT_S)
        assert started, f"job {job_id} did not start within {JOB_TIMEOUT_S} s"
        _run(["scontrol", "requeue", job_id])
        ended = _wait_until(lambda: _is_finished(job_id), REQUEUE_TIMEOUT_S)
        assert ended, (
            f"requeued job {job_id} not done after {REQUEUE_TIMEOUT_S} s: {output_lines()}"
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=COMMAND_TIMEOUT_S)

    assert _job_states(job_id) == ["COMPLETED"]
    assert output_lines() == ["run restart_count=unset", "run restart_count=1"]
