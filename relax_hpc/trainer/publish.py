"""Publishing policy versions while the trainer trains on (``weightsync.background_send``).

A sync is a round with the rollout engines: called, ready, broadcast, verified, loaded,
reported. Done in the trainer's loop, the whole round sits between two training steps, and
an async run's step becomes the round plus the longer of generation and training (the
roles take turns at the round). ``BackgroundPublisher`` copies version N's weights (a
snapshot: the next step changes the live ones in place) and sends them from a thread while
the loop reads the next batch and trains; the next version waits for this one's send to
end, so versions still reach the engines one at a time and in order, each whole.
``ChildPublisher`` does the same over a sender running in a process of its own
(``weightsync.send_process``): no thread and no snapshot of its own.

Staleness control is unchanged: every sample carries the version it was generated with,
the engine loads only verified, complete versions, and the spool still drops samples past
``max_staleness``. What changes is when the trainer learns how a sync went: its report
(members, drops) comes with the next publish (the metrics lag one sync), and its errors
are raised there, or by ``wait``.

Must not: gather the weights (a collective: the caller does it on every rank) or send from
more than one thread at a time.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping

import torch

log = logging.getLogger(__name__)

# (weights, policy_version, only) -> the sync's metrics
SyncFn = Callable[[Mapping[str, torch.Tensor], int, "list[str] | None"], dict[str, float]]


def snapshot(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A host copy of ``weights`` that the next optimiser step does not change (the bucket
    transport stages weights in host memory anyway)."""
    return {name: t.detach().to("cpu", copy=True) for name, t in weights.items()}


class BackgroundPublisher:
    """At most one sync in flight, on one long-lived thread; ``publish`` returns the previous
    one's metrics (plus how long it waited for it, ``weightsync/wait_previous_s``).

    The thread is started once and then handed each version: starting a thread per step
    made the trainer wait for the new thread to be scheduled (~0.4 ms a step on 2 busy
    cores)."""

    def __init__(self, sync: SyncFn) -> None:
        self.sync = sync
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._in_flight = False
        self._thread: threading.Thread | None = None
        self._metrics: dict[str, float] = {}
        self._error: BaseException | None = None

    def publish(self, weights: Mapping[str, torch.Tensor], policy_version: int) -> dict:
        start = time.perf_counter()
        metrics = self.wait()
        metrics["weightsync/wait_previous_s"] = time.perf_counter() - start
        copy = snapshot(weights)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="weightsync-send", daemon=True)
            self._thread.start()
        self._done.clear()
        self._in_flight = True
        self._jobs.put((copy, policy_version))
        return metrics

    def publish_now(
        self, weights: Mapping[str, torch.Tensor], policy_version: int, only: list[str] | None
    ) -> dict[str, float]:
        """A sync in the caller's thread (joiners catching up), after the one in flight."""
        self.wait()
        return self.sync(weights, policy_version, only)

    def wait(self) -> dict[str, float]:
        """Until the sync in flight ended; its metrics; re-raises its error."""
        if not self._in_flight:
            return {}
        self._done.wait()
        self._in_flight = False
        error, self._error = self._error, None
        if error is not None:
            raise error
        metrics, self._metrics = self._metrics, {}
        return metrics

    def close(self) -> None:
        """Until the sync in flight ended (re-raising its error); then the thread ends."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread.join()
                self._thread = None

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)
            del job  # the snapshot is not kept alive while the next one is taken
            self._done.set()

    def _run(self, weights: dict[str, torch.Tensor], policy_version: int) -> None:
        try:
            self._metrics = self.sync(weights, policy_version, None)
        except BaseException as error:  # raised in the trainer's thread at the next wait
            log.warning("weightsync: sending policy_version %d failed: %s", policy_version, error)
            self._error = error


class ChildPublisher:
    """``BackgroundPublisher``'s calls for a sender in a child process
    (``weightsync.sender_process.SenderProcess``): ``publish`` copies version N's weights
    into the memory the child sends from and returns while the child runs the round.

    No thread: in the trainer's process a thread handed the version waits for the training
    loop to let go of the GIL before it can pass it on (measured on 2 cores: 6 ms from the
    hand-off to the round's start, which the engines' generation then waits for)."""

    def __init__(self, sender, metrics_of: Callable[[object], dict[str, float]]) -> None:
        self.sender = sender  # begin_sync / end_sync / sync / in_flight
        self.metrics_of = metrics_of  # a SyncReport -> the sync's metrics

    def publish(self, weights: Mapping[str, torch.Tensor], policy_version: int) -> dict:
        start = time.perf_counter()
        metrics = self.wait()
        metrics["weightsync/wait_previous_s"] = time.perf_counter() - start
        self.sender.begin_sync(weights, policy_version)
        return metrics

    def publish_now(
        self, weights: Mapping[str, torch.Tensor], policy_version: int, only: list[str] | None
    ) -> dict[str, float]:
        """A sync the caller waits for (joiners catching up), after the one in flight."""
        self.wait()
        return self.metrics_of(self.sender.sync(weights, policy_version, only))

    def wait(self) -> dict[str, float]:
        """Until the sync in flight ended; its metrics; raises its error."""
        if not self.sender.in_flight:
            return {}
        return self.metrics_of(self.sender.end_sync())

    def close(self) -> None:
        self.wait()
