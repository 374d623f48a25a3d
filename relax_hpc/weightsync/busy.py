"""How long a round waits for an alive engine's answer: a bound derived from step times.

An async engine answers a round's call once it finished the chunk it is generating, and
how long that takes follows the run's pace. The pace is measured here as the time between
two syncs (a training step plus waiting for samples; the syncs themselves excluded, so a
round that waited on a hung engine does not raise the next bound) and as how long the
engines took to answer the rounds every one of them answered (a chunk can outlast a step
when the trainer trains from a backlog). A connected engine may take
``weightsync.busy_steps`` times the longest of the last ``WINDOW`` of either to answer, at
least ``busy_floor_s`` (an engine descheduled for a moment is not hung) and at most
``busy_timeout_s``; before the first step between two syncs, ``busy_timeout_s``. A stopped (SIGSTOP) or
frozen engine keeps its liveness connection open, so this bound, not the connection, ends
the wait: the engine is dropped and comes back as a joiner once it runs again, or once its
keeper restarted it. Must not: know about rounds, engines or the store.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

WINDOW = 8  # syncs whose preceding step times are remembered


class BusyBound:
    def __init__(
        self,
        busy_steps: float,
        floor_s: float,
        busy_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.busy_steps = busy_steps
        self.floor_s = floor_s
        self.busy_timeout_s = busy_timeout_s
        self._clock = clock
        self._step_s: deque[float] = deque(maxlen=WINDOW)
        self._answer_s: deque[float] = deque(maxlen=WINDOW)
        self._last_end: float | None = None

    def sync_started(self) -> None:
        """A full sync begins: the time since the last one ended was a step."""
        if self._last_end is not None:
            self._step_s.append(self._clock() - self._last_end)

    def sync_ended(self) -> None:
        self._last_end = self._clock()

    def answered(self, seconds: float) -> None:
        """Every engine of a round answered its call, the last after ``seconds``."""
        self._answer_s.append(seconds)

    def seconds(self) -> float:
        """How long a connected engine may take to answer a round's call."""
        if not self.busy_steps or not self._step_s:
            return self.busy_timeout_s
        derived = self.busy_steps * max([*self._step_s, *self._answer_s])
        return min(max(derived, self.floor_s), self.busy_timeout_s)
