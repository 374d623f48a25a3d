"""``python -m relax_hpc.status RUN_DIR``: what an operator wants to know about a run.

Job and component states (Slurm, via sacct), starts and restarts, device-hours so far,
trainer step and policy version, spool backlog, last metrics, last complete checkpoint,
held-out accuracy, and the recoveries (``observe/recoveries.py``: restarts in place, weight
sync's dropped engines, pending restart requests). Reads only the run directory and
Slurm's accounting; never touches the run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from relax_hpc import exitcodes
from relax_hpc.checkpoint.store import latest_checkpoint
from relax_hpc.observe.cost import CostLedger, cost_so_far, describe_cost
from relax_hpc.observe.recoveries import run_recovery_lines
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import backlog

SHOWN_METRICS = ("reward/mean", "reward/accuracy", "loss/actor", "staleness/mean", "actor/entropy")


def job_lines(paths: RunPaths) -> list[str]:
    job = read_json(paths.job_file, default=None)
    if job is None:
        return ["job: not submitted to Slurm (local run or prepare_only)"]
    if shutil.which("sacct") is None:
        return [f"job: Slurm job {job['job_id']} (sacct not available here)"]
    from relax_hpc.launch.slurm import job_state

    state = job_state(str(job["job_id"]))
    return [
        f"job: Slurm job {job['job_id']} {state['State']} (components {state['Components']}; "
        f"nodes {state['NodeList'] or '-'})"
    ]


def trainer_lines(paths: RunPaths) -> list[str]:
    status = read_json(paths.trainer_status, default=None)
    if status is None:
        return ["trainer: no step finished yet"]
    age = time.time() - status.get("time", time.time())
    metrics = status.get("metrics", {})
    shown = ", ".join(f"{k} {metrics[k]:.4g}" for k in SHOWN_METRICS if k in metrics)
    lines = [
        f"trainer: step {status['step']} (policy_version {status.get('policy_version', status['step'])}), "
        f"last update {age:.0f} s ago",
        f"metrics: {shown}",
    ]
    if paths.trainer_done.exists():
        lines.append("trainer: finished")
    return lines


def reward_lines(paths: RunPaths) -> list[str]:
    """Reward services: failed samples and retries per part (rollout workers' last report),
    and what each judge server has served."""
    lines = []
    totals: dict[str, float] = {}
    for path in sorted(paths.status_dir.glob(paths.rollout_status("*").name)):
        metrics = read_json(path, default={}).get("metrics", {})
        for key, value in metrics.items():
            if key.startswith("rewards/") and key.endswith("_total"):
                totals[key] = totals.get(key, 0.0) + value
    parts = sorted({key.split("/")[1] for key in totals})
    for part in parts:
        figures = {
            key.split("/")[-1].removesuffix("_total"): v
            for key, v in totals.items()
            if key.split("/")[1] == part
        }
        lines.append(
            f"rewards: {part} failed {figures.get('failed', 0):.0f} of "
            f"{figures.get('samples', 0):.0f} samples, {figures.get('retries', 0):.0f} retries, "
            f"circuit opened {figures.get('circuit_opened', 0):.0f}x, waited "
            f"{figures.get('wait_s', 0):.0f} s"
        )
    for path in sorted(paths.status_dir.glob(paths.judge_status("*").name)):
        judge = read_json(path, default={})
        age = time.time() - judge.get("time", time.time())
        lines.append(
            f"judge {path.stem.removeprefix('judge-')}: {judge.get('scored', 0)} samples judged "
            f"({judge.get('samples_per_s', 0):.0f}/s), {judge.get('refused', 0)} requests refused, "
            f"last report {age:.0f} s ago"
        )
    return lines


def other_lines(paths: RunPaths) -> list[str]:
    lines = []
    info = latest_checkpoint(paths)
    lines.append(
        f"checkpoint: step {info.step} at {info.path}" if info else "checkpoint: none complete yet"
    )
    if paths.spool_dir.is_dir():
        ready = backlog(paths.spool_dir)
        lines.append(
            f"spool: {ready.num_ready_groups} groups / {ready.num_ready_samples} samples ready, "
            f"oldest policy_version {ready.oldest_policy_version}"
        )
    evals = read_json(paths.eval_history, default={}).get("history", [])
    if evals:
        lines.append(
            f"eval: held-out accuracy {evals[-1]['accuracy']:.1%} at policy_version "
            f"{evals[-1]['policy_version']} (first {evals[0]['accuracy']:.1%})"
        )
    if paths.cancel_request.exists():
        lines.append("control: cancel requested")
    return lines


def attempt_lines(paths: RunPaths) -> list[str]:
    """Starts and restarts of the job and its device-hours (from the watcher's ledger)."""
    ledger = CostLedger(paths.cost_ledger)
    attempts = ledger.attempts()
    if not attempts:
        return ["starts: none recorded yet"]
    running = not paths.trainer_done.exists()
    return [
        f"starts: {len(attempts)} (restarts {ledger.restarts()}), elapsed "
        f"{ledger.elapsed_s() / 60:.1f} min, last start {time.ctime(attempts[-1]['start_s'])}",
        describe_cost(cost_so_far(paths, running=running)),
    ]


def status_lines(run_dir: Path) -> list[str]:
    paths = RunPaths(run_dir)
    if not paths.resolved_config.is_file():
        raise ValueError(f"{run_dir} is not a relax_hpc run directory (no config.yaml)")
    return [
        f"run: {paths.root}",
        *job_lines(paths),
        *attempt_lines(paths),
        *run_recovery_lines(paths),
        *trainer_lines(paths),
        *reward_lines(paths),
        *other_lines(paths),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m relax_hpc.status", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        print("\n".join(status_lines(args.run_dir)))
    except ValueError as err:
        print(f"relax_hpc status: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
