"""Local tasks get their role's cpus_per_task CPUs of their own, as Slurm's task affinity
gives them (launch/cpu_binding.py), and the trainer's helpers the CPUs it was not given."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from relax_hpc.launch.cpu_binding import helper_cpus, plan_cpu_binding
from relax_hpc.launch.local import LocalExecutor
from relax_hpc.launch.plan import JobPlan, RolePlan
from relax_hpc.paths import RunPaths
from relax_hpc.runtime import HELPER_CPUS_VAR, format_cpus
from relax_hpc.runtime import helper_cpus as helper_cpus_from_environ


def plan(*roles: tuple[str, int, int], overlap: bool = False, command=("true",)) -> JobPlan:
    """A plan of (role, tasks, cpus_per_task); ``overlap``: the rollout time-shares (sync)."""
    return JobPlan(
        name="t",
        run_dir="/nonexistent",
        shape="hetjob",
        mode="sync" if overlap else "async",
        roles=tuple(
            RolePlan(name, "test", 1, tasks, 0, cpus, 1, None, tuple(command), overlap=overlap)
            for name, tasks, cpus in roles
        ),
        time_min=10,
        account=None,
        qos=None,
        signal_grace_s=5,
        max_restarts=0,
    )


def test_two_cpus_give_the_trainer_one_and_the_rollout_the_other():
    binding = plan_cpu_binding(plan(("trainer", 1, 1), ("rollout", 1, 1)), [0, 1])
    assert binding == {("trainer", 0): (0,), ("rollout", 0): (1,)}
    assert helper_cpus(binding, [0, 1]) == (1,)


def test_tasks_take_their_cpus_per_task_in_role_then_rank_order():
    roles = plan(("trainer", 2, 2), ("rollout", 2, 1), ("judge", 1, 1))
    binding = plan_cpu_binding(roles, [2, 3, 4, 5, 6, 7, 8, 9])  # a cgroup's CPUs
    assert binding == {
        ("trainer", 0): (2, 3),
        ("trainer", 1): (4, 5),
        ("rollout", 0): (6,),
        ("rollout", 1): (7,),
        ("judge", 0): (8,),
    }
    assert helper_cpus(binding, [2, 3, 4, 5, 6, 7, 8, 9]) == (6, 7, 8, 9)


def test_nothing_is_bound_when_the_tasks_do_not_fit_or_the_roles_take_turns():
    assert plan_cpu_binding(plan(("trainer", 1, 2), ("rollout", 1, 1)), [0, 1]) == {}
    assert plan_cpu_binding(plan(("trainer", 1, 1), ("rollout", 1, 1)), [0]) == {}
    sync = plan(("trainer", 1, 1), ("rollout", 1, 1), overlap=True)
    assert plan_cpu_binding(sync, [0, 1, 2, 3]) == {}
    assert helper_cpus({}, [0, 1]) == (0, 1)


def test_the_helper_cpus_variable_reads_back_and_a_malformed_one_is_named():
    assert helper_cpus_from_environ({}) is None
    assert helper_cpus_from_environ({HELPER_CPUS_VAR: format_cpus((1, 3))}) == {1, 3}
    for bad in ("", "1,x", "-1"):
        with pytest.raises(ValueError, match=HELPER_CPUS_VAR):
            helper_cpus_from_environ({HELPER_CPUS_VAR: bad})


RECORD = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    out = pathlib.Path(sys.argv[1]) / (sys.argv[2] + ".json")
    record = {"cpus": sorted(os.sched_getaffinity(0)), "helpers": os.environ.get(sys.argv[3])}
    out.write_text(json.dumps(record))
    while sys.argv[2] == "trainer" and not out.with_name("rollout.json").exists():
        time.sleep(0.01)  # the run ends with the trainer: the rollout records first
    """
)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs 2 CPUs to split between the roles (CI's machine has them)",
)
@pytest.mark.parametrize("bind", [True, False])
def test_the_local_executor_starts_each_task_on_its_cpus(tmp_path, bind):
    script = tmp_path / "record.py"
    script.write_text(RECORD)
    available = sorted(os.sched_getaffinity(0))

    def role(name: str) -> RolePlan:
        command = (sys.executable, str(script), str(tmp_path), name, HELPER_CPUS_VAR)
        return RolePlan(name, "test", 1, 1, 0, 1, 1, None, command)

    jobs = plan(("trainer", 1, 1), ("rollout", 1, 1))
    jobs = JobPlan(**{**jobs.__dict__, "roles": (role("trainer"), role("rollout"))})
    executor = LocalExecutor(jobs, RunPaths(tmp_path), poll_s=0.05, bind_cpus=bind)
    executor.run()
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    rollout = json.loads((tmp_path / "rollout.json").read_text())
    if bind:
        assert (trainer["cpus"], rollout["cpus"]) == ([available[0]], [available[1]])
        assert trainer["helpers"] == format_cpus(available[1:])
        assert rollout["helpers"] is None
    else:
        assert trainer["cpus"] == rollout["cpus"] == available
        assert trainer["helpers"] is None
