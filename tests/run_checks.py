"""Checks on a run's processes and spool shared by the e2e and the Slurm tests."""

from __future__ import annotations

import subprocess

from relax_hpc.paths import RunPaths, read_json


def trained_and_published(paths: RunPaths) -> tuple[list[list[str]], list]:
    """Sample ids trained per step, and every sample of the consumed shards (every shard
    that left ``ready/``, kept by ``spool.keep_consumed``)."""
    from relax_hpc.spool import read_shard

    trained = read_json(paths.consumed_sample_ids)
    samples = [
        sample
        for shard in (paths.spool_dir / "consumed").iterdir()
        for group in read_shard(shard)[1]
        for sample in group
    ]
    return trained, samples


def rollout_pids(run_dir) -> set[int]:
    """The processes whose command line is the run's rollout task: its keeper and its
    worker (and, in a Slurm step, the srun that started the keeper)."""
    pattern = f"relax_hpc.component rollout --run-dir {run_dir}"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, timeout=30)
    return {int(pid) for pid in found.stdout.split()}
