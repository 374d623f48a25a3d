"""sacct parsing for heterogeneous jobs (Slurm faked only at the subprocess boundary)."""

from __future__ import annotations

import subprocess

from relax_hpc.launch.slurm import combine_states, job_state, parse_sacct

SACCT_HETJOB = """JobID|State|NodeList
41+0|COMPLETED|node0
41+1|COMPLETED|node1
42+0|RUNNING|node2
42+1|FAILED|node3
43|CANCELLED by 0|node0
44+0|RUNNING|node0
44+1|PENDING|None assigned
"""


def test_hetjob_rows_fold_into_the_leader():
    jobs = parse_sacct(SACCT_HETJOB)
    assert jobs["41"]["State"] == "COMPLETED" and jobs["41"]["NodeList"] == "node0,node1"
    assert jobs["42"]["State"] == "FAILED"  # one failed component fails the job
    assert jobs["43"]["State"] == "CANCELLED"
    assert jobs["44"]["State"] == "RUNNING"
    assert jobs["42"]["Components"] == "0:RUNNING,1:FAILED"


def test_steps_and_empty_output_are_ignored():
    assert parse_sacct("JobID|State\n7+0.batch|COMPLETED\n7+0.0|FAILED\n") == {}
    assert parse_sacct("") == {}


def test_combine_states():
    assert combine_states(["REQUEUED", "PENDING"]) == "REQUEUED"
    assert combine_states([]) == "UNKNOWN"


def test_job_state_when_sacct_fails_is_unknown_not_done():
    def failing(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "Slurm accounting storage is disabled")

    assert job_state("5", run=failing)["State"] == "UNKNOWN"


def test_job_not_yet_in_sacct_is_pending():
    def empty(*args, **kwargs):
        return subprocess.CompletedProcess(args, 0, "JobID|State|NodeList\n", "")

    assert job_state("5", run=empty)["State"] == "PENDING"
