"""Device-hours from the job plan and the attempts ledger."""

from __future__ import annotations

import json

import pytest

from relax_hpc.config.compose import compose_run_config
from relax_hpc.launch.plan import build_job_plan
from relax_hpc.observe.cost import CostLedger, StepCostMetrics, device_hours, role_devices
from relax_hpc.paths import RunPaths, atomic_write_text


def _devices(*overrides: str):
    cfg = compose_run_config(list(overrides))
    return role_devices(json.loads(build_job_plan(cfg, "/tmp/r").to_json()))


def test_hetjob_on_gpus_counts_each_role_and_sums_them():
    devices = {d.role: d for d in _devices("+experiment=grpo_qwen3")}
    assert devices["trainer"].kind == "gpu" and devices["trainer"].count == 8
    assert devices["rollout"].count == 8 and not devices["rollout"].shared
    hours = device_hours(list(devices.values()), elapsed_s=1800)
    assert hours == {
        "cost/gpu_hours/trainer": 4.0,
        "cost/gpu_hours/rollout": 4.0,
        "cost/gpu_hours/total": 8.0,
    }


def test_sync_colocation_counts_shared_devices_once():
    devices = _devices("+experiment=grpo_qwen3_colocate")
    hours = device_hours(devices, elapsed_s=3600)
    trainer_gpus = next(d.count for d in devices if d.role == "trainer")
    assert hours["cost/gpu_hours/total"] == pytest.approx(trainer_gpus)
    assert next(d for d in devices if d.role == "rollout").shared


def test_cpu_run_counts_cpu_hours():
    devices = _devices("+experiment=grpo_tiny")
    assert {d.kind for d in devices} == {"cpu"}
    assert device_hours(devices, 3600)["cost/cpu_hours/total"] == sum(d.count for d in devices)


def test_ledger_sums_attempts_and_the_running_one(tmp_path, fake_clock):
    clock = fake_clock(now=0.0)
    ledger = CostLedger(tmp_path / "cost.json", clock)
    ledger.start_attempt("9", 0)
    clock.now = 100.0
    ledger.tick()
    clock.now = 160.0  # requeue gap: not billed
    ledger.start_attempt("9", 1)
    clock.now = 200.0
    ledger.tick()
    clock.now = 230.0
    assert ledger.elapsed_s() == 140.0
    assert ledger.elapsed_s(running=True) == 170.0
    assert ledger.restarts() == 1


def test_step_metrics_include_hours_per_step(tmp_path):
    paths = RunPaths(tmp_path / "run").create()
    cfg = compose_run_config(["+experiment=grpo_tiny"])
    atomic_write_text(paths.job_plan, build_job_plan(cfg, str(paths.root)).to_json())
    step_cost_metrics = StepCostMetrics(paths)
    assert step_cost_metrics(3) == {}  # nothing measured yet
    ledger = CostLedger(paths.cost_ledger)
    ledger.start_attempt("1", 0)
    metrics = step_cost_metrics(4)
    total = metrics["cost/cpu_hours/total"]
    assert total > 0
    assert metrics["cost/cpu_hours_per_step/total"] == pytest.approx(total / 4, rel=0.05)


def test_step_metrics_read_the_ledger_at_most_every_refresh_and_run_the_clock_between(
    tmp_path, fake_clock
):
    """The trainer asks every step; the files are read again only after ``refresh_s``, and
    in between the running attempt lasts until the clock's now (as the ledger would say)."""
    paths = RunPaths(tmp_path / "run").create()
    cfg = compose_run_config(["+experiment=grpo_tiny"])
    atomic_write_text(paths.job_plan, build_job_plan(cfg, str(paths.root)).to_json())
    clock = fake_clock(now=1000.0)
    ledger = CostLedger(paths.cost_ledger, clock)
    ledger.start_attempt("1", 0)
    metrics = StepCostMetrics(paths, refresh_s=5.0, clock=clock)
    clock.now = 1003.0
    per_second = metrics(1)["cost/cpu_hours/total"] / 3.0
    paths.cost_ledger.write_text("not json")  # a read now would fail: none happens
    clock.now = 1004.0
    assert metrics(2)["cost/cpu_hours/total"] == pytest.approx(4 * per_second)
    clock.now = 1008.0  # refresh_s after the first read (1003): the ledger is read again
    assert metrics(3) == {}  # an unreadable ledger measures nothing, as before
    atomic_write_text(
        paths.cost_ledger,
        json.dumps(
            {"attempts": [{"job_id": "1", "restart": 0, "start_s": 1000.0, "last_s": 1001.0}]}
        ),
    )
    # billed until the last tick (1001) plus the running attempt until now (1008)
    assert metrics(4)["cost/cpu_hours/total"] == pytest.approx(8 * per_second)
    assert metrics(4)["cost/cpu_hours_per_step/total"] == pytest.approx(8 * per_second / 4)
