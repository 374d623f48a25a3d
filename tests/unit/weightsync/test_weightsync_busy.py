"""The bound a round waits for an alive engine's answer, from step and answer times."""

from __future__ import annotations

from relax_hpc.weightsync.busy import WINDOW, BusyBound


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def steps(bound: BusyBound, clock: Clock, *step_s: float, sync_s: float = 0.0) -> None:
    """Syncs of ``sync_s`` each, separated by steps of ``step_s``."""
    for seconds in step_s:
        bound.sync_started()
        clock.now += sync_s
        bound.sync_ended()
        clock.now += seconds


def test_the_bound_follows_the_longest_recent_step_within_its_limits():
    clock = Clock()
    bound = BusyBound(busy_steps=4, floor_s=10, busy_timeout_s=3600, clock=clock)
    assert bound.seconds() == 3600  # nothing observed yet
    steps(bound, clock, 30, 20)
    bound.sync_started()
    assert bound.seconds() == 4 * 30
    steps(bound, clock, 1, 1)
    assert bound.seconds() == 4 * 30  # the longest of the window
    steps(bound, clock, *[1] * WINDOW)
    bound.sync_started()
    assert bound.seconds() == 10  # 4 x 1 s, but never below floor_s
    steps(bound, clock, 5000)
    bound.sync_started()
    assert bound.seconds() == 3600  # never above busy_timeout_s


def test_a_round_that_waited_does_not_raise_the_next_bound():
    """The sync's own time (waiting out a hung engine) is not a step."""
    clock = Clock()
    bound = BusyBound(busy_steps=4, floor_s=1, busy_timeout_s=3600, clock=clock)
    steps(bound, clock, 2, 2, 2, sync_s=8)
    bound.sync_started()
    assert bound.seconds() == 8


def test_slow_answers_raise_the_bound_and_zero_busy_steps_turns_it_off():
    clock = Clock()
    bound = BusyBound(busy_steps=4, floor_s=1, busy_timeout_s=3600, clock=clock)
    steps(bound, clock, 2, 2)
    bound.answered(50)  # engines finishing long chunks while the trainer trains a backlog
    assert bound.seconds() == 200
    off = BusyBound(busy_steps=0, floor_s=1, busy_timeout_s=30, clock=clock)
    steps(off, clock, 2, 2)
    assert off.seconds() == 30
