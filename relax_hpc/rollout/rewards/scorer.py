"""Fault-tolerant scoring: rewards run in a child process with a per-sample timeout.

A reward that raises, or runs past ``rollout.reward_timeout_s``, scores 0 with the reason in
``RewardResult.failed``; the worker keeps going. ``RewardScorer`` runs rewards in a child
process (forkserver) so that a hung reward can be killed; the few built-ins that cannot
hang (``IN_PROCESS_REWARDS``) score in the caller's process.

Must not: import torch, the engines or the trainer; rewards see text, not tokens.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from multiprocessing.pool import Pool
from typing import Any, NamedTuple

from relax_hpc.rollout.rewards.registry import RewardNameError, resolve_reward
from relax_hpc.rollout.rewards.result import RewardResult, call_reward

log = logging.getLogger(__name__)

# Pool.terminate() waits on the task queue's lock; a pool worker killed while it held it (a
# stop signal sent to the task's whole process group reaches the idle worker too) leaves
# that lock taken forever. close() gives terminate() this long, then kills the workers.
CLOSE_TIMEOUT_S = 5.0

# Built-in rewards that score in the caller's process even with a timeout: their time is
# linear in the completion (a strip and a compare; no regular expression that can
# backtrack, no parser, no import), they cannot hang or crash the interpreter, and an
# exception is recorded as a failed reward as in the child. The child's round trip (the
# pool's three threads, pickling each sample, a wake-up per result) cost more CPU per step
# than scoring itself. Every other reward (math-verify, regexes, user code) keeps the child.
IN_PROCESS_REWARDS = frozenset({"exact_match"})

# Not SIGTERM: Pool.terminate() stops a hung reward with it (and a TERM from Slurm ends
# the whole step anyway).
STOP_SIGNALS_IGNORED = (signal.SIGUSR1, signal.SIGINT)


def score_one(
    spec: str, completion: str, answer: str, metadata: Mapping[str, Any], prompt: str = ""
) -> RewardResult:
    """Resolve ``spec`` and score one completion (what the child process runs).

    Rule rewards see ``(completion, answer, metadata)``; ``prompt`` is for the services."""
    try:
        fn = resolve_reward(spec)
    except RewardNameError as error:
        return RewardResult(0.0, failed=str(error))
    return call_reward(fn, completion, answer, metadata)


def resolve_reward_in_child(spec: str) -> None:
    resolve_reward(spec)


class ScoreItem(NamedTuple):
    """One sample to score. Plain ``(completion, answer, metadata)`` tuples are accepted too."""

    completion: str
    answer: str
    metadata: Mapping[str, Any]
    prompt: str = ""  # the text the policy was given (judges and reward models read it)


def as_score_item(item: Sequence[Any]) -> ScoreItem:
    return item if isinstance(item, ScoreItem) else ScoreItem(*item)


@contextlib.contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """Processes started inside inherit SIG_IGN for the stop signals.

    Slurm delivers a step's signals to every process of the task. The reward server and its
    workers must outlive the stop request (USR1): the rollout finishes scoring its batch,
    then closes the pool. (USR1's default action would kill them, leaving the rollout
    waiting on a dead pool until the step is killed.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS_IGNORED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def build_reward(spec: str, timeout_s: float | None = 10.0) -> RewardScorer:
    """``rollout.reward`` and ``rollout.reward_timeout_s`` as a scorer (call it, or ``score``)."""
    return RewardScorer(spec, timeout_s)


class RewardScorer:
    """Scores completions with ``spec`` in one child process, with a per-sample timeout.

    The child runs the samples of a batch in order, so each sample gets ``timeout_s`` from
    the moment the previous one finished. On a timeout the child is killed, the sample is
    recorded as failed, and the rest of the batch goes to a fresh child.
    ``timeout_s=None`` scores in this process (no isolation, no timeout; tests, debugging),
    and so does a reward of ``IN_PROCESS_REWARDS`` (it cannot hang).
    """

    def __init__(self, spec: str, timeout_s: float | None = 10.0) -> None:
        resolve_reward(spec)  # fail on a bad spec now, in the parent, with a clear message
        self.spec = spec
        self.timeout_s = timeout_s
        self._pool: Pool | None = None

    @property
    def in_process(self) -> bool:
        return self.timeout_s is None or self.spec in IN_PROCESS_REWARDS

    def score(self, items: Sequence[ScoreItem]) -> list[RewardResult]:
        if self.in_process:
            return [score_one(self.spec, *item) for item in items]
        results: list[RewardResult] = []
        while len(results) < len(items):
            results += self._score_until_timeout(items[len(results) :])
        return results

    def __call__(self, completion: str, record: Any) -> RewardResult:
        """Score one completion of a prompt record (anything with ``answer`` and ``metadata``)."""
        return self.score([(completion, record.answer, record.metadata)])[0]

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            terminate_bounded(pool, CLOSE_TIMEOUT_S)

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _score_until_timeout(self, items: Sequence[ScoreItem]) -> list[RewardResult]:
        """Results for a prefix of ``items``, ending with the first timed-out one, if any."""
        pool = self._started_pool()
        handles = [pool.apply_async(score_one, (self.spec, *item)) for item in items]
        results = []
        for handle in handles:
            try:
                results.append(handle.get(timeout=self.timeout_s))
            except multiprocessing.TimeoutError:
                self.close()  # the only way to stop a hung reward
                reason = f"timed out after {self.timeout_s} s (rollout.reward_timeout_s)"
                return [*results, RewardResult(0.0, failed=reason)]
        return results

    def _started_pool(self) -> Pool:
        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            # Preload only this module: the server must not re-import the caller's __main__.
            context.set_forkserver_preload([__name__])
            with stop_signals_ignored():
                self._pool = context.Pool(processes=1)
            # Start-up and imports happen now, so they never count against a sample's timeout.
            self._pool.apply(resolve_reward_in_child, (self.spec,))
        return self._pool


def terminate_bounded(pool: Pool, timeout_s: float) -> None:
    """``pool.terminate()`` and ``join()``, given up after ``timeout_s`` (see
    ``CLOSE_TIMEOUT_S``): its workers are then killed outright and the rollout goes on."""

    def terminate() -> None:
        pool.terminate()
        pool.join()

    closer = threading.Thread(target=terminate, name="reward-pool-close", daemon=True)
    closer.start()
    closer.join(timeout_s)
    if closer.is_alive():
        for worker in list(pool._pool):  # the pool's own handles on its worker processes
            with contextlib.suppress(OSError, ValueError, AttributeError):
                worker.kill()
        log.warning("reward pool: terminate() blocked %.0f s (a worker died holding the "
                    "queue lock); its workers were killed", timeout_s)  # fmt: skip
