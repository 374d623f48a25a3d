"""What ``python -m relax_hpc.scale add`` buys and what ``add``/``drain`` cost, on one local run.

Starts ``grpo_tiny`` (``cluster=local``, async, no warm start, a long run), then in that one
run measures:

1. the trainer's samples/s over ``--window-s`` with the run's own rollout worker alone;
2. ``scale add N``: how long the command takes, and how long until the pool's first worker
   publishes its first prompt group (process start, model build, weights, first chunk);
3. the samples/s over the same window with the pool beside the run's worker, and the share
   of the groups the pool published;
4. ``scale drain``: how long until the pool's supervisor has exited (chunks in hand finished
   and published first);
5. the samples/s once alone again.

It prints the ratios (with the pool / alone). On a machine with fewer cores than roles the
pool competes with the trainer for CPU, so the ratio says what more workers cost there as
much as what they buy; on a cluster a pool gets nodes of its own. Usage:
    python benchmarks/scaling.py [--workers 1] [--window-s 30]
"""

from __future__ import annotations

import argparse
import os
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
RUN = [
    "mode=async",
    "max_staleness=1",
    "model.warm_start=false",
    "trainer.total_steps=1000000",  # ended by a cancel
    "trainer.checkpoint_interval_steps=100000",
    "rollout.eval_interval_steps=0",
]


def start_run(run_dir: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "relax_hpc.submit",
        "+experiment=grpo_tiny",
        "cluster=local",
        f"run_dir={run_dir}",
        *RUN,
    ]
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


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


def supervisor_gone(paths: RunPaths) -> bool:
    pid = read_json(paths.pool_record(POOL), default={}).get("pid")
    if pid is None:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and " Z " in Path(f"/proc/{pid}/stat").read_text()


def measure(run_dir: Path, workers: int, window_s: float) -> dict[str, float]:
    paths = RunPaths(run_dir)
    run = start_run(run_dir)
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
            lambda: supervisor_gone(paths), 600, "the pool supervisor's exit"
        )
        result["after_samples_per_s"] = samples_per_s(paths, window_s)
    finally:
        request_cancel(run_dir)
        run.wait(timeout=600)
    return result


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
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--window-s", type=float, default=30.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="relax-scaling-") as root:
        result = measure(Path(root) / "run", args.workers, args.window_s)
    report(result, args.workers)


if __name__ == "__main__":
    main()
