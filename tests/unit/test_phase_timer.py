"""PhaseTimer: wall seconds and CPU seconds per phase, and the process's CPU per step."""

from __future__ import annotations

import time

from relax_hpc.observe.metrics import PhaseTimer


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_phase_that_waits_costs_wall_time_and_one_that_computes_costs_cpu():
    timer = PhaseTimer()
    timer.pop()  # the process's CPU so far (imports) is not this step's
    with timer.phase("wait"):
        time.sleep(0.2)
    with timer.phase("compute"):
        spin(0.2)
    with timer.phase("compute"):
        spin(0.1)
    metrics = timer.pop()
    assert metrics["time/wait_s"] >= 0.2 and metrics["cpu/wait_s"] < 0.05
    assert metrics["cpu/compute_s"] >= 0.3 and metrics["time/compute_s"] >= 0.3
    assert metrics["cpu/process_s"] >= 0.3
    assert set(timer.pop()) == {"cpu/process_s"}  # reset: only the process's CPU since
