"""The trainer's own group across two processes (gloo), formed through the run directory,
and how a rank of it leaves: after every rank is done, with its exit code, its log lines
flushed and the interpreter's shutdown skipped, where gloo's threads aborted ranks of clean
runs (SIGABRT) while FSDP2 still held the group."""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os

import torch
from test_checkpoint_dist import full_weights, sharded_model

from relax_hpc import exitcodes
from relax_hpc.paths import RunPaths
from relax_hpc.runtime import TaskIdentity
from relax_hpc.trainer.group import init_trainer_group, leave_group_and_exit

WORLD_SIZE = 2


def identity_of(rank: int) -> TaskIdentity:
    return TaskIdentity(
        rank=rank,
        world_size=WORLD_SIZE,
        local_rank=rank,
        job_id="local-1",
        restart_count=0,
        launcher="local",
    )


def rank_main(rank: int, run_dir: str) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, filename=f"{run_dir}/rank{rank}.log")
    atexit.register(lambda: open(f"{run_dir}/shutdown{rank}", "w").close())
    init_trainer_group(RunPaths(run_dir), identity_of(rank), "gloo", timeout_s=60)
    model, optimizer = sharded_model(seed=0)  # held, as the trainer's are, to the end
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    full_weights(model)
    logging.getLogger("rank").info("trained on rank %d", rank)
    leave_group_and_exit(exitcodes.STOPPED)


def test_each_rank_leaves_the_group_with_its_exit_code_and_its_log_flushed(tmp_path):
    RunPaths(tmp_path).create()
    context = multiprocessing.get_context("spawn")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ranks = [
        context.Process(target=rank_main, args=(rank, str(tmp_path))) for rank in range(WORLD_SIZE)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in ranks] == [exitcodes.STOPPED] * WORLD_SIZE
    for rank in range(WORLD_SIZE):
        assert f"trained on rank {rank}" in (tmp_path / f"rank{rank}.log").read_text()
        # the interpreter's shutdown (atexit, then freeing the group) did not run
        assert not (tmp_path / f"shutdown{rank}").exists()
