"""Submission to Slurm through submitit, of exactly the script ``dry_run`` prints.

submitit has no heterogeneous-job support and expects a pickled function; relax_hpc
submits its own rendered script instead (``_make_submission_file_text`` returns it) and
keeps submitit's submission, job-id parsing and state watching. The watcher maps
``sacct``'s heterogeneous rows (``<id>+0``, ``<id>+1``) to the job: a job one of whose
components failed is failed, never waited on forever.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable

from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from relax_hpc.paths import RunPaths, atomic_write_json

# Component states that end the job as a failure whatever the other components do.
FAILED_STATES = (
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "TIMEOUT",
    "BOOT_FAIL",
    "DEADLINE",
    "CANCELLED",
)
FINAL_STATES = ("COMPLETED", *FAILED_STATES)


def combine_states(states: Iterable[str]) -> str:
    """One state for a job from its components' states (``CANCELLED by 0`` -> CANCELLED)."""
    plain = [state.split()[0] for state in states if state]
    if not plain:
        return "UNKNOWN"
    for failed in FAILED_STATES:
        if failed in plain:
            return failed
    if all(state == "COMPLETED" for state in plain):
        return "COMPLETED"
    for state in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"):
        if state in plain:
            return state
    return plain[0]


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """``sacct -P -o JobID,State,NodeList`` -> {job id: {"State", "NodeList", "Components"}}.

    Steps (``12.batch``, ``12+0.0``) are skipped; hetjob rows ``12+k`` fold into ``12``.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) < 2:
        return {}
    names = lines[0].split("|")
    components: dict[str, dict[str, dict[str, str]]] = {}
    for line in lines[1:]:
        row = dict(zip(names, line.split("|"), strict=False))
        job_id = row.get("JobID", "")
        if not job_id or "." in job_id:
            continue
        leader, _, offset = job_id.partition("+")
        components.setdefault(leader, {})[offset or "0"] = row
    return {
        leader: {
            "State": combine_states(row.get("State", "") for row in rows.values()),
            "NodeList": ",".join(row.get("NodeList", "") for _, row in sorted(rows.items())),
            "Components": ",".join(
                f"{k}:{row.get('State', '')}" for k, row in sorted(rows.items())
            ),
        }
        for leader, rows in components.items()
    }


class HetJobWatcher(SlurmInfoWatcher):
    def read_info(self, string: bytes | str) -> dict[str, dict[str, str]]:
        return parse_sacct(string.decode() if isinstance(string, bytes) else string)


class RelaxSlurmJob(SlurmJob):
    watcher = HetJobWatcher(delay_s=60)


class ScriptExecutor(SlurmExecutor):
    """A submitit executor whose submission file is a script relax_hpc rendered."""

    job_class = RelaxSlurmJob

    def __init__(self, folder, script: str) -> None:
        super().__init__(folder=folder)
        self.script = script

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script

    def _num_tasks(self) -> int:
        return 1


def submit_script(paths: RunPaths, script: str) -> str:
    """Submit ``script`` (the run's job.sbatch text); record the job id in the run directory."""
    folder = paths.submitit_dir
    folder.mkdir(parents=True, exist_ok=True)  # submitit writes the submission file there first
    job = ScriptExecutor(folder, script)._submit_command("relax_hpc")
    atomic_write_json(paths.job_file, {"job_id": job.job_id, "submitted_at": time.time()})
    return job.job_id


def submit_pool_script(paths: RunPaths, script: str, pool: str) -> str:
    """Submit an extra rollout pool's script (``launch/pool_sbatch.py``); its job id."""
    folder = paths.submitit_dir / f"pool-{pool}"
    folder.mkdir(parents=True, exist_ok=True)
    return ScriptExecutor(folder, script)._submit_command("relax_hpc").job_id


Runner = Callable[..., subprocess.CompletedProcess]


def job_state(job_id: str, run: Runner = subprocess.run) -> dict[str, str]:
    """The job's combined state from ``sacct`` (all its runs: requeues show as more rows)."""
    result = run(
        ["sacct", "-j", job_id, "-P", "-X", "-o", "JobID,State,NodeList"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0:
        return {"State": "UNKNOWN", "NodeList": "", "Components": result.stderr.strip()}
    return parse_sacct(result.stdout).get(
        job_id, {"State": "PENDING", "NodeList": "", "Components": ""}
    )


def wait_for_job(
    job_id: str, timeout_s: float, poll_s: float = 2.0, run: Runner = subprocess.run
) -> str:
    """Poll until the job reaches a final state; raise TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id, run)["State"]
        if state in FINAL_STATES:
            return state
        time.sleep(poll_s)
    raise TimeoutError(f"Slurm job {job_id} did not finish within {timeout_s} s")
