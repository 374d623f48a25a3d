"""Per-step progress lines: the first few, then at most one per interval, and the forced
ones (observe.metrics.LogThrottle)."""

from __future__ import annotations

from relax_hpc.observe.metrics import LogThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_calls_then_one_per_interval_and_every_forced_one():
    clock = Clock()
    throttle = LogThrottle(interval_s=1.0, first=3, clock=clock)
    due = []
    for step in range(1, 41):  # 40 steps of 0.125 s (exact in binary)
        due.append(throttle.due(force=step == 40))
        clock.now += 0.125
    printed = [step for step, is_due in zip(range(1, 41), due, strict=True) if is_due]
    assert printed[:3] == [1, 2, 3]
    assert printed[3:] == [11, 19, 27, 35, 40]  # a second after the last line, and the end
