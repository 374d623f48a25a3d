"""What ``python -m relax_hpc.scale add`` buys, what ``add``/``drain`` cost, and what each
recovery costs, on one run of the local executor or of a Slurm cluster.

Starts ``grpo_tiny`` (``--cluster local`` or ``slurm``: async, no warm start, a long run),
then in that one run measures:

1. the trainer's samples/s over ``--window-s`` with the run's own rollout worker alone;
2. ``scale add N``: how long the command takes, and how long until the pool's first worker
   publishes its first prompt group (process start, model build, weights, first chunk);
3. the samples/s over the same window with the pool beside the run's worker, and the share
   of the groups the pool published;
4. ``scale drain``: how long until the pool's supervisor has exited (chunks in hand finished
   and published first);
5. the samples/s once alone again;
6. the cost of each recovery, as seconds without progress: from a SIGKILL of the run's own
   rollout worker (restarted in place by its keeper) and of the trainer (restarted alone
   on the local executor, the job requeued on Slurm) until the trainer passes the step it
   had reached (steps since the last checkpoint are trained again), next to the mean step
   time before the kill.

It prints the ratios (with the pool / alone). On a machine with fewer cores than roles the
pool competes with the trainer for CPU, so the ratio says what more workers cost there as
much as what they buy; on a cluster a pool gets nodes of its own. Usage:
    python benchmarks/scaling.py [--cluster local|slurm] [--workers 1] [--window-s 30]
(``--cluster slurm`` needs a cluster: ``scripts/slurm_local.sh start`` and its ``env``.)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from relax_hpc.cancel import request_cancel
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool.layout import SpoolLayout

REPO = Path(__file__).resolve().parents[1]

POOL = "xbench"
SETTLE_STEPS = 3
RUN = [
    "mode=async",
    "max_staleness=1",
    "model.warm_start=false",
    "trainer.total_steps=1000000",  # ended by a cancel
    "trainer.checkpoint_interval_steps=10",  # a killed trainer retrains at most 10 steps
    "rollout.eval_interval_steps=0",
    "cluster.time_min=60",
]


class Run:
    """One long run on ``cluster``; ``stop()`` cancels it and waits for its end."""

    def __init__(self, run_dir: Path, cluster: str) -> None:
        self.run_dir = run_dir
        command = [
            sys.executable,
            "-m",
            "relax_hpc.submit",
            "+experiment=grpo_tiny",
            f"cluster={cluster}",
            f"run_dir={run_dir}",
            *RUN,
        ]
        quiet = {"cwd": REPO, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.process = None
        if cluster == "local":  # submit supervises the run until it ends
            self.process = subprocess.Popen(command, **quiet)
        else:  # submit returns once the job is queued
            subprocess.run(command, check=True, timeout=300, **quiet)

    def stop(self) -> None:
        request_cancel(self.run_dir)
        if self.process is not None:
            self.process.wait(timeout=600)
            return
        from relax_hpc.launch.slurm import wait_for_job

        wait_for_job(str(read_json(RunPaths(self.run_dir).job_file)["job_id"]), timeout_s=600)


def scale(run_dir: Path, *args: str) -> float:
    """Run ``python -m relax_hpc.scale RUN_DIR args``; the seconds it took."""
    started = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "relax_hpc.scale", str(run_dir), *args],
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=900,
    )
    return time.monotonic() - started


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` holds."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if condition():
            return time.monotonic() - started
        time.sleep(0.1)
    raise TimeoutError(f"not within {timeout_s} s: {what}")


def trainer_step(paths: RunPaths) -> int:
    return int(read_json(paths.trainer_status, default={}).get("step", 0))


def recovery_cost_s(
    paths: RunPaths, pid: int, current_pid: Callable[[], int | None], window_s: float
) -> tuple[float, float]:
    """SIGKILL ``pid``: the longest time without a new highest trainer step from the kill
    until its replacement runs and the trainer is ``SETTLE_STEPS`` past where it was, and
    the mean step time over ``window_s`` before the kill."""
    step, started = trainer_step(paths), time.monotonic()
    time.sleep(window_s)
    best = trainer_step(paths)
    step_s = (time.monotonic() - started) / max(best - step, 1)
    os.kill(pid, signal.SIGKILL)
    last_progress, longest, target = time.monotonic(), 0.0, None
    deadline = last_progress + 900
    while target is None or best < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no recovery from the SIGKILL of {pid} within 900 s")
        now, reached = time.monotonic(), trainer_step(paths)
        if reached > best:  # steps trained again after a resume are not progress
            longest, best, last_progress = max(longest, now - last_progress), reached, now
        if target is None and current_pid() not in (None, pid):
            target = best + SETTLE_STEPS
        time.sleep(0.05)
    return longest, step_s


def trained_samples(paths: RunPaths) -> float:
    status = read_json(paths.trainer_status, default={})
    return float(status.get("metrics", {}).get("progress/samples", 0.0))


def samples_per_s(paths: RunPaths, window_s: float) -> float:
    before, started = trained_samples(paths), time.monotonic()
    time.sleep(window_s)
    return (trained_samples(paths) - before) / (time.monotonic() - started)


def published_groups(paths: RunPaths, writer: str) -> int:
    status = SpoolLayout(paths.spool_dir).writer_status_path(writer)
    return int(read_json(status, default={}).get("num_groups", 0))


def pool_groups(paths: RunPaths, workers: int) -> int:
    return sum(published_groups(paths, f"rollout.{POOL}.{i}") for i in range(workers))


def pool_gone(paths: RunPaths) -> bool:
    """The pool's supervisor process (local) or job (Slurm) has ended."""
    record = read_json(paths.pool_record(POOL), default={})
    if "job_id" in record:
        from relax_hpc.launch.slurm import FINAL_STATES, job_state

        return job_state(str(record["job_id"]))["State"] in FINAL_STATES
    pid = record.get("pid")
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, TypeError):
        return True
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and " Z " in stat.read_text()  # exited, not yet reaped


def measure(run_dir: Path, cluster: str, workers: int, window_s: float) -> dict[str, float]:
    paths = RunPaths(run_dir)
    run = Run(run_dir, cluster)
    try:
        wait_until(lambda: trained_samples(paths) > 0, 900, "the first training step")
        result = {"alone_samples_per_s": samples_per_s(paths, window_s)}
        result["add_command_s"] = scale(run_dir, "add", str(workers), "--pool", POOL)
        result["add_to_first_group_s"] = result["add_command_s"] + wait_until(
            lambda: pool_groups(paths, workers) > 0, 600, "the pool's first group"
        )
        own_before, pool_before = published_groups(paths, "rollout.r0"), pool_groups(paths, workers)
        result["pooled_samples_per_s"] = samples_per_s(paths, window_s)
        own = published_groups(paths, "rollout.r0") - own_before
        pool = pool_groups(paths, workers) - pool_before
        result["pool_share"] = pool / max(own + pool, 1)
        result["drain_command_s"] = scale(run_dir, "drain", POOL)
        result["drain_to_exit_s"] = result["drain_command_s"] + wait_until(
            lambda: pool_gone(paths), 600, "the pool's end"
        )
        result["after_samples_per_s"] = samples_per_s(paths, window_s)
        result.update(recovery_costs(paths, window_s))
    finally:
        run.stop()
    return result


def recovery_costs(paths: RunPaths, window_s: float) -> dict[str, float]:
    def worker_pid() -> int | None:
        return read_json(paths.rollout_assignment_dir / "workers" / "r0.json", default={}).get(
            "pid"
        )

    def trainer_pid() -> int | None:
        return read_json(paths.rendezvous_dir / "trainer.json", default={}).get("pid")

    rollout_gap_s, rollout_step_s = recovery_cost_s(paths, worker_pid(), worker_pid, window_s)
    trainer_gap_s, trainer_step_s = recovery_cost_s(paths, trainer_pid(), trainer_pid, window_s)
    return {
        "rollout_kill_no_progress_s": rollout_gap_s,
        "rollout_kill_step_s_before": rollout_step_s,
        "trainer_kill_no_progress_s": trainer_gap_s,
        "trainer_kill_step_s_before": trainer_step_s,
    }


def report(result: dict[str, float], workers: int) -> None:
    alone = result["alone_samples_per_s"]
    print(f"{'measure':<34} {'value':>10}")
    for name, value in result.items():
        print(f"{name:<34} {value:>10.3f}")
    print(
        f"ratio with {workers} pool worker(s) / alone: {result['pooled_samples_per_s'] / alone:.2f}"
    )
    print(f"ratio after the drain / alone:       {result['after_samples_per_s'] / alone:.2f}")
    print(f"cores here: {os.cpu_count()} (roles compete for them; a cluster pool has its own)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", choices=("local", "slurm"), default="local")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--window-s", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-scaling-") as root:
        result = measure(Path(root) / "run", args.cluster, args.workers, args.window_s)
    print(f"cluster: {args.cluster}")
    report(result, args.workers)


if __name__ == "__main__":
    main()
