"""Retry pacing for reward servers: exponential backoff with jitter, and a circuit breaker.

The breaker stops a crowd of requests from hammering a server that is down: after
``failures`` failures in a row it *opens* for ``reset_s`` (requests wait instead of
calling), then lets one probe through (*half-open*); the probe's success closes it, its
failure opens it again. Time comes from an injected clock so that tests need no sleeping.

Must not: do I/O or sleep; callers sleep for what ``wait_s`` and ``backoff_delay`` say.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

HALF_OPEN_POLL_S = 0.05  # how often requests queued behind a half-open probe look again


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Seconds before retry ``attempt`` (0 = the first retry): ``base * 2**attempt``,
    capped, times a uniform jitter in [0.5, 1.5) so that many clients do not retry in step."""
    return min(cap_s, base_s * 2 ** min(attempt, 32)) * rng.uniform(0.5, 1.5)


class CircuitBreaker:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(
        self, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.threshold = failures
        self.reset_s = reset_s
        self.clock = clock
        self.state = self.CLOSED
        self.consecutive_failures = 0
        self.times_opened = 0
        self._open_until = 0.0
        self._probe_out = False
        self._lock = threading.Lock()

    def wait_s(self) -> float:
        """0 when a request may go now (the caller then reports its outcome), else how long
        to wait before asking again."""
        with self._lock:
            if self.state == self.CLOSED:
                return 0.0
            now = self.clock()
            if self.state == self.OPEN and now < self._open_until:
                return self._open_until - now
            if self._probe_out:
                return HALF_OPEN_POLL_S
            self.state, self._probe_out = self.HALF_OPEN, True
            return 0.0

    def succeeded(self) -> None:
        with self._lock:
            self.state, self.consecutive_failures, self._probe_out = self.CLOSED, 0, False

    def failed(self) -> None:
        with self._lock:
            self.consecutive_failures += 1
            reopen = self.state == self.HALF_OPEN
            if reopen or (
                self.state == self.CLOSED and self.consecutive_failures >= self.threshold
            ):
                self.state, self._open_until = self.OPEN, self.clock() + self.reset_s
                self.times_opened += 1
            self._probe_out = False
