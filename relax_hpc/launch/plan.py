"""The job plan: what a run asks of the cluster, independent of how it is launched.

One plan feeds three consumers: the sbatch renderer (``dry_run`` and submission), the
Slurm executor, and the local executor. Shape rules:

- ``hetjob``: the roles have nodes of their own (hybrid/async without ``share_nodes``);
  one heterogeneous job, component 0 = trainer, component 1 = rollout, component 2 = the
  judge when ``judge.placement=component``. Slurm 22.05 never places two components of
  one hetjob on the same node, so this shape needs a node per component at least.
- ``single``: the roles share nodes (``sync`` time-shares every device; ``share_nodes``
  splits each node's GPUs); one allocation, one step per role. A judge of its own gets
  devices of its own in that allocation (its step never overlaps another).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field

from relax_hpc.config.schema import RunConfig
from relax_hpc.config.validate import data_parallel_size

COMPONENT_MODULE = "relax_hpc.component"


@dataclass(frozen=True)
class RolePlan:
    role: str  # trainer | rollout | judge
    backend: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: int  # GPUs this role's step uses on each node
    cpus_per_task: int
    mem_gb: int
    partition: str | None
    command: tuple[str, ...]
    overlap: bool = False  # sync: the step time-shares devices with the other role
    layout: str = ""  # human summary of the parallel layout

    @property
    def num_tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class JobPlan:
    name: str
    run_dir: str
    shape: str  # hetjob | single
    mode: str
    roles: tuple[RolePlan, ...]
    time_min: int
    account: str | None
    qos: str | None
    signal_grace_s: int
    max_restarts: int
    run_lock_wait_s: int = 120
    setup: tuple[str, ...] = ()
    extra_sbatch: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def role(self, name: str) -> RolePlan:
        return next(r for r in self.roles if r.role == name)

    @property
    def total_gpus(self) -> int:
        # In sync mode the rollout's step overlaps the trainer's devices: counted once.
        return sum(r.nodes * r.gpus_per_node for r in self.roles if not shares_devices(r))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def shares_devices(role: RolePlan) -> bool:
    """A step that time-shares the trainer's devices (sync mode's rollout)."""
    return role.overlap and role.role != "trainer"


def job_shape(cfg: RunConfig) -> str:
    if cfg.mode == "sync" or cfg.cluster.share_nodes:
        return "single"
    return "hetjob"


def component_command(cfg: RunConfig, role: str, run_dir: str) -> tuple[str, ...]:
    """Every step runs the same entry point; the role is an argument, never guessed."""
    python = cfg.cluster.python or sys.executable  # submit resolves None; plans built directly too
    return (python, "-u", "-m", COMPONENT_MODULE, role, "--run-dir", run_dir)


def _trainer_plan(cfg: RunConfig, run_dir: str) -> RolePlan:
    trainer = cfg.trainer
    layout = trainer.parallel
    on_gpu = trainer.gpus_per_node > 0
    summary = (
        f"tensor {layout.tensor} x pipeline {layout.pipeline} x context {layout.context} "
        f"x data {data_parallel_size(trainer)}"
        + (f", expert {layout.expert}" if layout.expert > 1 else "")
    )
    return RolePlan(
        role="trainer",
        backend=trainer.backend,
        nodes=trainer.nodes,
        tasks_per_node=trainer.gpus_per_node if on_gpu else trainer.processes_per_node,
        gpus_per_node=trainer.gpus_per_node,
        cpus_per_task=trainer.cpus_per_task,
        mem_gb=trainer.mem_gb,
        partition=cfg.cluster.trainer_partition or cfg.cluster.partition,
        command=component_command(cfg, "trainer", run_dir),
        overlap=cfg.mode == "sync",
        layout=summary,
    )


def _rollout_plan(cfg: RunConfig, run_dir: str) -> RolePlan:
    rollout = cfg.rollout
    on_gpu = rollout.gpus_per_node > 0
    engines_per_node = (
        rollout.gpus_per_node // rollout.engine_tensor_parallel
        if on_gpu
        else rollout.workers_per_node
    )
    summary = f"{engines_per_node * rollout.nodes} engine(s) of tensor parallel {rollout.engine_tensor_parallel}"
    return RolePlan(
        role="rollout",
        backend=rollout.backend,
        nodes=rollout.nodes,
        # One task per engine: on GPU, task k of a node serves with its GPUs
        # k*TP .. (k+1)*TP-1 (every task sees the node's GPUs); on CPU one per worker.
        tasks_per_node=engines_per_node,
        gpus_per_node=rollout.gpus_per_node,
        cpus_per_task=rollout.cpus_per_task,
        mem_gb=rollout.mem_gb,
        partition=cfg.cluster.rollout_partition or cfg.cluster.partition,
        command=component_command(cfg, "rollout", run_dir),
        overlap=cfg.mode == "sync",
        layout=summary,
    )


def _judge_plan(cfg: RunConfig, run_dir: str) -> RolePlan:
    """The judge on nodes (or devices) of its own: one server task per engine; on CPU one
    per node."""
    judge = cfg.judge
    assert judge is not None
    tasks = judge.gpus_per_node // judge.engine_tensor_parallel if judge.gpus_per_node else 1
    return RolePlan(
        role="judge",
        backend=judge.backend,
        nodes=judge.nodes,
        tasks_per_node=tasks,
        gpus_per_node=judge.gpus_per_node,
        cpus_per_task=judge.cpus_per_task,
        mem_gb=judge.mem_gb,
        partition=cfg.cluster.judge_partition or cfg.cluster.partition,
        command=component_command(cfg, "judge", run_dir),
        layout=f"{tasks * judge.nodes} judge server(s) of tensor parallel "
        f"{judge.engine_tensor_parallel}, frozen weights",
    )


def has_judge_component(cfg: RunConfig) -> bool:
    return cfg.judge is not None and cfg.judge.placement == "component"


def build_job_plan(cfg: RunConfig, run_dir: str) -> JobPlan:
    """The plan of a validated config; ``run_dir`` is written verbatim into commands."""
    cluster = cfg.cluster
    return JobPlan(
        name=cfg.name,
        run_dir=run_dir,
        shape=job_shape(cfg),
        mode=cfg.mode,
        roles=(_trainer_plan(cfg, run_dir), _rollout_plan(cfg, run_dir))
        + ((_judge_plan(cfg, run_dir),) if has_judge_component(cfg) else ()),
        time_min=cluster.time_min,
        account=cluster.account,
        qos=cluster.qos,
        signal_grace_s=cluster.signal_grace_s,
        max_restarts=cluster.max_restarts,
        run_lock_wait_s=cluster.run_lock_wait_s,
        setup=tuple(cluster.setup),
        extra_sbatch=tuple(sorted(cluster.extra_sbatch.items())),
    )


def describe_plan(plan: JobPlan) -> str:
    """A few lines a person reads before submitting (printed by ``dry_run``)."""
    shape = (
        "one heterogeneous Slurm job (a component per role)"
        if plan.shape == "hetjob"
        else "one allocation, one step per role"
    )
    lines = [f"job plan for {plan.name!r}: mode={plan.mode}, {shape}"]
    for index, role in enumerate(plan.roles):
        devices = f"{role.gpus_per_node} GPU(s)" if role.gpus_per_node else "CPU only"
        where = f"component {index}" if plan.shape == "hetjob" else "step"
        lines.append(
            f"  {where} {role.role}: {role.backend}, {role.nodes} node(s) x {devices}, "
            f"{role.tasks_per_node} task(s)/node, {role.cpus_per_task} CPU(s)/task, "
            f"{role.mem_gb} GB; {role.layout}"
        )
    lines.append(
        f"  time limit {plan.time_min} min, advance signal {plan.signal_grace_s} s before it, "
        f"up to {plan.max_restarts} automatic restarts; {plan.total_gpus} GPU(s) in all"
    )
    lines.append(f"  run directory {plan.run_dir}")
    return "\n".join(lines)
