"""A group dropped as stale is generated again and trained once (spool/redo.py).

Provoked for real: async mode with ``max_staleness=1`` and three workers; one is
SIGSTOPped while it holds a claim (generating with the weights of then), the others feed
the trainer past two more versions (the stopped engine is dropped from the weight-sync
round after ``weightsync.busy_timeout_s``), then it is continued and publishes its chunk,
which the trainer drops as stale. The drop becomes a redo request; a worker regenerates
it and it is trained. Exactly-once is checked against the sample ids read from every
shard that left ``ready/`` (``spool.keep_consumed``), not against the trained ids."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter

import pytest
from e2e_helpers import REPO, failure_report, submit_command, submit_env, wait_for_step

from relax_hpc.cancel import request_cancel
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.rollout.assignment import chunk_holders
from relax_hpc.spool import read_shard
from relax_hpc.spool.layout import SpoolLayout
from relax_hpc.spool.redo import attempt_of, open_requests

pytestmark = pytest.mark.slow
PROMPTS = 6
STALE_ASYNC = [
    "mode=async",
    "max_staleness=1",
    "rollout.workers_per_node=3",
    "rollout.cpus_per_task=1",
    f"rollout.prompts_per_step={PROMPTS}",
    "rollout.n_samples_per_prompt=2",
    "rollout.eval_interval_steps=0",
    "model.warm_start=false",
    "trainer.total_steps=100000",  # ended by a cancel once the redo was trained
    "trainer.checkpoint_interval_steps=2",
    "rollout.claim_lease_s=600",  # the stopped worker keeps its claim: no takeover
    "weightsync.timeout_s=10",
    "weightsync.busy_timeout_s=10",  # the stopped engine leaves the round after this
    "observe.audit_sample_ids=true",
    "spool.keep_consumed=true",
]


def counters(paths: RunPaths) -> Counter:
    return Counter(read_json(paths.spool_dir / "reader.json", default={}).get("counters", {}))


def step_of(paths: RunPaths) -> int:
    return read_json(paths.trainer_status, default={}).get("step", 0)


def wait_until(condition, run, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert run.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.2)


def provoke_stale_drop(paths: RunPaths, run) -> None:
    """Stop r1 while it generates, let the trainer move two versions on, continue it;
    again if its chunk was published before the stop landed."""
    pid = read_json(paths.rollout_assignment_dir / "workers" / "r1.json")["pid"]
    for _ in range(3):
        wait_until(lambda: "r1" in chunk_holders(paths.rollout_assignment_dir), run, "r1 claims")
        os.kill(pid, signal.SIGSTOP)
        stopped_at = step_of(paths)
        try:
            wait_until(lambda s=stopped_at: step_of(paths) >= s + 3, run, "steps without r1")
        finally:
            os.kill(pid, signal.SIGCONT)
        try:
            wait_until(lambda: counters(paths)["num_stale_groups"] > 0, run, "a stale drop", 60)
            return
        except AssertionError:
            continue
    raise AssertionError("no stale drop in three tries")


def left_ready(paths: RunPaths) -> dict[str, set[str]]:
    """Prompt group -> sample ids of every shard that left ``ready/``."""
    groups: dict[str, set[str]] = {}
    for folder in ("consumed", "claimed"):
        for shard in (paths.spool_dir / folder).glob("*.h5"):
            for group in read_shard(shard)[1]:
                groups.setdefault(group[0].group_id, set()).update(s.sample_id for s in group)
    return groups


def test_a_stale_group_is_generated_again_and_trained_once(tmp_path):
    run_dir, paths = tmp_path / "run", RunPaths(tmp_path / "run")
    run = subprocess.Popen(
        submit_command(run_dir, *STALE_ASYNC, "cluster.max_restarts=0"),
        cwd=REPO,
        env=submit_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(paths.trainer_status, 2, run, timeout_s=600)
        provoke_stale_drop(paths, run)
        redo_dir = SpoolLayout(paths.spool_dir).redo_dir
        wait_until(
            lambda: (
                counters(paths)["num_regenerated_groups"]
                >= counters(paths)["num_redo_requested_groups"]
                > 0
                and not open_requests(redo_dir)
            ),
            run,
            "every redo trained",
        )
        last_step = step_of(paths)
        wait_until(lambda: step_of(paths) >= last_step + 2, run, "two more steps")
    finally:
        request_cancel(run_dir)
        _, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, failure_report(
        subprocess.CompletedProcess([], 1, "", stderr), run_dir
    )
    final = counters(paths)
    assert final["num_stale_groups"] >= 1 and final["num_regenerated_groups"] >= 1, final
    assert final["num_lost_groups"] == final["num_redo_abandoned_groups"] == 0, final

    trained_steps = read_json(paths.consumed_sample_ids)
    trained = [s for step in trained_steps for s in step]
    assert len(trained) == len(set(trained))  # no sample twice
    trained_by_group: dict[str, set[int]] = {}
    for sample in trained:
        trained_by_group.setdefault(sample.split("/")[0], set()).add(attempt_of(sample))
    published = left_ready(paths)
    redone = {g for g, attempts in trained_by_group.items() if max(attempts) > 0}
    assert redone, trained_by_group
    # the consumed range: every group up to the last redone one's batch and one more
    end = (max(int(g) for g in redone) // PROMPTS + 2) * PROMPTS
    for g in map(str, range(end)):
        assert len(trained_by_group.get(g, ())) == 1, (g, trained_by_group.get(g))  # once
        assert published[g] >= {s for s in trained if s.split("/")[0] == g}, g
        untrained = published[g] - set(trained)
        if g in redone:  # its stale copy was published and dropped, its redo trained
            assert untrained and all(attempt_of(s) < max(trained_by_group[g]) for s in untrained)
        else:
            assert not untrained, (g, untrained)  # nothing of it lost
