"""The sbatch script of an extra rollout pool of a Slurm run (``relax_hpc.scale add``).

A job of its own beside the run's job: ``N`` rollout tasks with the resources of the run's
rollout role (or the operator's overrides: another partition, a preemptible QoS), that
join the running run through its run directory. It never requeues: preempted, cancelled
or out of time, its workers publish the chunk in hand (SIGTERM) and leave, and their
unfinished claims pass to the other workers; the run goes on. Slurm's warning before the
time limit is the same stop request.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, replace

from relax_hpc.launch.plan import JobPlan, RolePlan
from relax_hpc.launch.sbatch import format_time
from relax_hpc.paths import RunPaths, task_log_name

STOP_SIGNAL = "TERM"
STOP_GRACE_S = 120


@dataclass(frozen=True)
class PoolPlacement:
    """Where the pool runs: the run's rollout resources unless overridden."""

    partition: str | None = None
    qos: str | None = None
    account: str | None = None
    time_min: int | None = None


def load_job_plan(paths: RunPaths) -> JobPlan:
    """The run's job plan as submit wrote it (``job_plan.json``)."""
    raw = json.loads(paths.job_plan.read_text(encoding="utf-8"))
    roles = tuple(RolePlan(**{**r, "command": tuple(r["command"])}) for r in raw.pop("roles"))
    raw["setup"] = tuple(raw.get("setup", ()))
    raw["extra_sbatch"] = tuple(tuple(pair) for pair in raw.get("extra_sbatch", ()))
    return JobPlan(roles=roles, **raw)


def render_pool_sbatch(
    plan: JobPlan, paths: RunPaths, pool: str, workers: int, where: PoolPlacement
) -> str:
    rollout = plan.role("rollout")
    per_node = max(min(rollout.tasks_per_node, workers), 1)
    nodes = -(-workers // per_node)
    rollout = replace(rollout, partition=where.partition or rollout.partition)
    command = [*rollout.command, "--pool", pool]
    lines = [
        "#!/bin/bash",
        f"# relax_hpc extra rollout pool {pool} of run {plan.name!r}: {workers} worker(s) that",
        "# join the running run through its run directory and leave when it ends, when",
        f"# drained (python -m relax_hpc.scale {plan.run_dir} drain {pool}) or when stopped.",
        "# Never requeued: the run goes on without it.",
        f"#SBATCH --job-name=relax-{plan.name}-{pool}",
        f"#SBATCH --output={paths.pool_log(pool)}",
        "#SBATCH --open-mode=append",
        "#SBATCH --no-requeue",
        f"#SBATCH --signal=B:{STOP_SIGNAL}@{STOP_GRACE_S}",
        f"#SBATCH --time={format_time(where.time_min or plan.time_min)}",
    ]
    for key, value in (
        ("partition", rollout.partition),
        ("account", where.account or plan.account),
        ("qos", where.qos or plan.qos),
    ):
        if value:
            lines.append(f"#SBATCH --{key}={value}")
    lines += [
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks={workers}",
        f"#SBATCH --ntasks-per-node={per_node}",
        f"#SBATCH --cpus-per-task={rollout.cpus_per_task}",
        f"#SBATCH --mem={rollout.mem_gb}G",
    ]
    if rollout.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={rollout.gpus_per_node}")
    lines += ["", "set -uo pipefail", "export PYTHONUNBUFFERED=1", *plan.setup, ""]
    srun = [
        "srun",
        f"--ntasks={workers}",
        f"--cpus-per-task={rollout.cpus_per_task}",
        f"--output={plan.run_dir}/{task_log_name('rollout', f'{pool}.%t')}",
        "--open-mode=append",
        *map(shlex.quote, command),
    ]
    lines += [
        "# SIGTERM (scancel, preemption, the time-limit warning) reaches the workers: each",
        "# publishes the chunk in hand and exits.",
        "trap 'kill -TERM \"$step\" 2>/dev/null' TERM",
        " ".join(srun) + " &",
        "step=$!",
        'wait "$step"; code=$?',
        'if kill -0 "$step" 2>/dev/null; then wait "$step"; code=$?; fi',
        'echo "relax_hpc: pool ' + pool + ' ended with exit code $code"',
        'exit "$code"',
    ]
    return "\n".join(lines) + "\n"
