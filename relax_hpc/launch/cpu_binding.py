"""Which CPUs each local task runs on: its role's ``cpus_per_task`` of its own, as Slurm's
task affinity gives a step's tasks (``cluster.bind_cpus``).

Unbound on a small machine, the kernel moves the trainer and the rollout worker across the
same cores and lets the trainer's weight-send child run on the trainer's core, right
when the trainer reads its next batch: ``grpo_tiny`` async on 2 cores stepped at
1.21-1.23x its training time unbound and 1.18-1.20x with the trainer on one core and the
rollout (its worker and the trainer's send child) on the other (docs/performance.md
section 12; the child on the trainer's core: 1.26).

Binding applies only when every task's CPUs fit in the machine's (the CPUs this process
may use) and the roles run side by side: in sync mode the rollout time-shares the
trainer's resources, and either may use them all in turn. Must not: start processes.
"""

from __future__ import annotations

from collections.abc import Sequence

from relax_hpc.launch.plan import JobPlan, shares_devices

TaskKey = tuple[str, int]  # (role, rank)


def plan_cpu_binding(plan: JobPlan, available: Sequence[int]) -> dict[TaskKey, tuple[int, ...]]:
    """Each task's CPUs, in role order then rank order, or {} when they do not all fit or
    a role time-shares another's resources (then nothing is bound)."""
    if any(shares_devices(role) for role in plan.roles):
        return {}
    cpus = sorted(available)
    binding, used = {}, 0
    for role in plan.roles:
        for rank in range(role.num_tasks):
            binding[(role.role, rank)] = tuple(cpus[used : used + role.cpus_per_task])
            used += role.cpus_per_task
    if used > len(cpus):
        return {}
    return binding


def helper_cpus(binding: dict[TaskKey, tuple[int, ...]], available: Sequence[int]) -> tuple:
    """The CPUs no trainer task is bound to: where the trainer's helpers run."""
    trainer = {cpu for (role, _), cpus in binding.items() if role == "trainer" for cpu in cpus}
    return tuple(cpu for cpu in sorted(available) if cpu not in trainer)
