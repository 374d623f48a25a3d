"""Cost accounting: device-hours (GPU-hours, or CPU-hours on CPU) per role and in total.

A Slurm job holds its whole allocation for as long as it runs, so a role's cost is its
allocated devices times the job's elapsed time, summed over the job's attempts (one per
start: the first run and every requeue). The attempts live in ``RunPaths.cost_ledger``,
written only by the run watcher (``relax_hpc.observe.watch``), which opens an attempt when
a job starts and refreshes its ``last_s`` while it runs. The trainer (TensorBoard), the
``status`` command and the final alert only read it.

Devices of a role: ``nodes x gpus_per_node`` GPUs, or ``nodes x tasks x cpus_per_task`` CPUs.
In ``sync`` mode the rollout time-shares the trainer's devices (``overlap``): it is shown,
but counted once in the total.

Must not: import torch, or write anything but the ledger.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.paths import RunPaths, atomic_write_json, read_json

SECONDS_PER_HOUR = 3600.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleDevices:
    role: str
    kind: str  # gpu | cpu
    count: int
    shared: bool  # time-shares the devices of another role (counted once in the total)


def role_devices(plan: dict) -> list[RoleDevices]:
    """Devices each role of a job plan (``job_plan.json`` as a dict) holds."""
    devices = []
    for role in plan["roles"]:
        gpus = role["nodes"] * role["gpus_per_node"]
        cpus = role["nodes"] * role["tasks_per_node"] * role["cpus_per_task"]
        kind = "gpu" if gpus else "cpu"
        shared = bool(role.get("overlap")) and role["role"] != "trainer"
        devices.append(RoleDevices(role["role"], kind, gpus or cpus, shared))
    return devices


def device_hours(devices: list[RoleDevices], elapsed_s: float) -> dict[str, float]:
    """``cost/<kind>_hours/<role>`` and ``cost/<kind>_hours/total`` for ``elapsed_s``."""
    hours = elapsed_s / SECONDS_PER_HOUR
    out: dict[str, float] = {}
    for dev in devices:
        out[f"cost/{dev.kind}_hours/{dev.role}"] = dev.count * hours
        if not dev.shared:
            total = f"cost/{dev.kind}_hours/total"
            out[total] = out.get(total, 0.0) + dev.count * hours
    return out


class CostLedger:
    """The job's attempts: ``[{"job_id", "restart", "start_s", "last_s"}, ...]``."""

    def __init__(self, path: Path, clock=time.time) -> None:
        self.path = path
        self.clock = clock
        self.write_failed = False  # warned once until a write succeeds again

    def attempts(self) -> list[dict]:
        return list(read_json(self.path, default={}).get("attempts", []))

    def start_attempt(self, job_id: str, restart: int) -> None:
        now = self.clock()
        attempt = {"job_id": job_id, "restart": restart, "start_s": now, "last_s": now}
        self._write([*self.attempts(), attempt])

    def tick(self) -> None:
        """The current (last) attempt is still running now."""
        attempts = self.attempts()
        if attempts:
            attempts[-1]["last_s"] = self.clock()
            self._write(attempts)

    def elapsed_s(self, running: bool = False) -> float:
        """Seconds over every attempt; ``running``: the last attempt lasts until now."""
        return elapsed_over(self.attempts(), self.clock() if running else None)

    def restarts(self) -> int:
        return max(0, len(self.attempts()) - 1)

    def _write(self, attempts: list[dict]) -> None:
        try:
            # Fsynced although rewritten every poll: this file is the only record of the
            # earlier attempts, and an unflushed rewrite could leave it empty after a crash.
            atomic_write_json(self.path, {"attempts": attempts})
        except OSError as err:  # a full filesystem: the run's end says so; keep watching
            if not self.write_failed:
                log.warning("cost ledger: cannot write %s: %s", self.path, err)
            self.write_failed = True
        else:
            self.write_failed = False


def _measured(paths: RunPaths) -> tuple[list[RoleDevices], list[dict]]:
    """The job plan's devices and the ledger's attempts (none when the plan is missing)."""
    plan = read_json(paths.job_plan, default=None)
    if plan is None:
        return [], []
    return role_devices(plan), CostLedger(paths.cost_ledger).attempts()


def cost_so_far(paths: RunPaths, running: bool = False) -> dict[str, float]:
    """Device-hours of the run until now (empty when the plan or ledger is missing)."""
    devices, attempts = _measured(paths)
    if not attempts:
        return {}
    return device_hours(devices, elapsed_over(attempts, time.time() if running else None))


def describe_cost(cost: dict[str, float]) -> str:
    """One line: ``gpu-hours: trainer 1.23, rollout 0.98, total 2.21``."""
    if not cost:
        return "cost: not measured yet"
    kinds = sorted({name.split("/")[1] for name in cost})
    parts = []
    for kind in kinds:
        roles = [(n.split("/")[2], v) for n, v in cost.items() if n.split("/")[1] == kind]
        roles.sort(key=lambda item: item[0] == "total")  # roles first, the total last
        shown = ", ".join(f"{role} {value:.3g}" for role, value in roles)
        parts.append(f"{kind.removesuffix('_hours').upper()}-hours: {shown}")
    return "cost: " + "; ".join(parts)


def elapsed_over(attempts: list[dict], now: float | None = None) -> float:
    """Seconds over ``attempts``; with ``now``, the last one is still running until then."""
    total = sum(a["last_s"] - a["start_s"] for a in attempts)
    if now is not None and attempts:
        total += max(0.0, now - attempts[-1]["last_s"])
    return total


class StepCostMetrics:
    """The trainer's per-step view: device-hours so far and their mean per step.

    Called with the step every step, it re-reads the job plan and the ledger at most every
    ``refresh_s`` (while nothing is measured yet, every time): the watcher refreshes the
    ledger only every few seconds anyway, and reading them every step cost ~0.2 ms of a
    ~50 ms ``grpo_tiny`` step. In between, the running attempt is extended to the clock's
    now, as ``CostLedger.elapsed_s(running=True)`` does.
    """

    def __init__(self, paths: RunPaths, refresh_s: float = 5.0, clock=time.time) -> None:
        self.paths, self.refresh_s, self.clock = paths, refresh_s, clock
        self._read_at = -float("inf")
        self._devices: list[RoleDevices] = []
        self._attempts: list[dict] = []

    def __call__(self, step: int) -> dict[str, float]:
        now = self.clock()
        if not self._attempts or now - self._read_at >= self.refresh_s:
            self._read_at = now
            self._devices, self._attempts = _measured(self.paths)
        if not self._attempts:
            return {}
        cost = device_hours(self._devices, elapsed_over(self._attempts, now))
        per_step = {
            name.replace("_hours/total", "_hours_per_step/total"): value / step
            for name, value in cost.items()
            if name.endswith("/total") and step > 0
        }
        return {**cost, **per_step}
