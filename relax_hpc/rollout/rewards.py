"""Rewards: the built-in registry, the one extension point, and fault-tolerant scoring.

A reward function has the signature::

    def my_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float | RewardResult

``completion`` is the generated text (special tokens removed), ``answer`` the dataset's
reference answer, ``metadata`` the prompt row's other columns. ``rollout.reward`` names a
built-in (``exact_match``, ``math``, ``format``) or, as the **one extension point** for user
code, ``"package.module:function"`` (importable on the rollout nodes, e.g. via
``PYTHONPATH`` in ``cluster.setup``).

A reward that raises, or runs past ``rollout.reward_timeout_s``, scores 0 with the reason in
``RewardResult.failed``; the worker keeps going. ``RewardScorer`` runs rewards in a child
process (forkserver) so that a hung reward can be killed.

Must not: import torch, the engines or the trainer; rewards see text, not tokens.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import multiprocessing
import re
import signal
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from typing import Any

# Not SIGTERM: Pool.terminate() stops a hung reward with it (and a TERM from Slurm ends
# the whole step anyway).
STOP_SIGNALS_IGNORED = (signal.SIGUSR1, signal.SIGINT)
# The tail of a response where a DAPO-style "Answer:" line counts; earlier text is reasoning.
ANSWER_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"Answer\s*:\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class RewardResult:
    score: float
    details: dict[str, Any] = field(default_factory=dict)
    failed: str | None = None  # why no score could be computed (score is then 0)


RewardFn = Callable[[str, str, Mapping[str, Any]], "float | RewardResult"]


def exact_match(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """1 if the completion equals the answer up to surrounding whitespace, else 0."""
    return RewardResult(float(completion.strip() == str(answer).strip()))


def math_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """1 if the final answer is mathematically equal to the reference (math-verify), else 0.

    DAPO-style: the final answer is the last ``\\boxed{...}`` of the completion, or else an
    ``Answer: ...`` line in its last ``ANSWER_TAIL_CHARS`` characters.
    """
    from math_verify import parse, verify  # imported here: slow, and only this reward needs it

    extracted = final_answer(completion)
    if extracted is None:
        return RewardResult(0.0, {"extracted": None})
    gold = parse(_as_boxed(str(answer)))
    predicted = parse(_as_boxed(extracted))
    correct = bool(gold) and bool(predicted) and verify(gold, predicted)
    return RewardResult(float(correct), {"extracted": extracted})


def format_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """1 if the completion states a final answer (boxed or ``Answer:``) and closes any ``<think>``."""
    has_answer = final_answer(completion) is not None
    think_closed = "<think>" not in completion or "</think>" in completion.split("<think>")[-1]
    details = {"has_answer": has_answer, "think_closed": think_closed}
    return RewardResult(float(has_answer and think_closed), details)


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_reward,
    "format": format_reward,
}


def final_answer(completion: str) -> str | None:
    """The content of the last ``\\boxed{...}``, else of the last ``Answer:`` line in the tail."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(completion[-ANSWER_TAIL_CHARS:])
    return lines[-1] if lines else None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, begin = 0, start + len("\\boxed{")
        for position in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth < 0:
                return text[begin:position]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def _as_boxed(expression: str) -> str:
    return expression if "\\boxed" in expression else f"\\boxed{{{expression}}}"


@functools.cache
def resolve_reward(spec: str) -> RewardFn:
    """A registry name or ``module:function``; ``ValueError`` naming ``rollout.reward`` otherwise."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"rollout.reward: {spec!r} is not a built-in reward ({', '.join(REWARDS)}); "
            "user rewards are written as module:function"
        )
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"rollout.reward: cannot import {module_name!r} ({error})") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"rollout.reward: {module_name} has no function {function_name!r}")
    return function


def call_reward(
    fn: RewardFn, completion: str, answer: str, metadata: Mapping[str, Any]
) -> RewardResult:
    """``fn``'s result as a ``RewardResult``; an exception or a non-finite score is a failure."""
    try:
        value = fn(completion, answer, metadata)
    except Exception as error:  # a broken reward scores 0; the worker keeps going
        last = traceback.extract_tb(error.__traceback__)[-1]
        where = f" at {last.filename}:{last.lineno}" if last else ""
        return RewardResult(0.0, failed=f"raised {type(error).__name__}: {error}{where}")
    result = value if isinstance(value, RewardResult) else RewardResult(_as_float(value))
    if not math.isfinite(result.score):
        return RewardResult(
            0.0, result.details, failed=f"returned a non-finite score {result.score}"
        )
    return result


def score_one(spec: str, completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """Resolve ``spec`` and score one completion (what the child process runs)."""
    try:
        fn = resolve_reward(spec)
    except ValueError as error:
        return RewardResult(0.0, failed=str(error))
    return call_reward(fn, completion, answer, metadata)


def resolve_reward_in_child(spec: str) -> None:
    resolve_reward(spec)


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


ScoreItem = tuple[str, str, Mapping[str, Any]]  # (completion, answer, metadata)


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
    ``timeout_s=None`` scores in this process (no isolation, no timeout; tests, debugging).
    """

    def __init__(self, spec: str, timeout_s: float | None = 10.0) -> None:
        resolve_reward(spec)  # fail on a bad spec now, in the parent, with a clear message
        self.spec = spec
        self.timeout_s = timeout_s
        self._pool: Pool | None = None

    def score(self, items: Sequence[ScoreItem]) -> list[RewardResult]:
        if self.timeout_s is None:
            return [score_one(self.spec, *item) for item in items]
        results: list[RewardResult] = []
        while len(results) < len(items):
            results += self._score_until_timeout(items[len(results) :])
        return results

    def __call__(self, completion: str, record: Any) -> RewardResult:
        """Score one completion of a prompt record (anything with ``answer`` and ``metadata``)."""
        return self.score([(completion, record.answer, record.metadata)])[0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

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
