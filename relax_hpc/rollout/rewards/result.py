"""What a reward returns, and how any return value becomes a ``RewardResult``.

Must not: import torch, the engines or the trainer; rewards see text, not tokens.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardResult:
    score: float
    details: dict[str, Any] = field(default_factory=dict)
    failed: str | None = None  # why no score could be computed (score is then 0)


def failed(reason: str, details: dict[str, Any] | None = None) -> RewardResult:
    """A sample no score could be computed for: 0, with the reason recorded."""
    return RewardResult(0.0, dict(details or {}), failed=reason)


class BatchScorer(Protocol):
    """Anything that scores a batch: one result per item, in order, never an exception.

    Items are ``rewards.scorer.ScoreItem`` (or plain ``(completion, answer, metadata)``).
    A part that cannot score an item returns ``failed(reason)`` for it.
    """

    def score(self, items: Sequence[Any]) -> list[RewardResult]: ...

    def close(self) -> None: ...


# fn(completion, answer, metadata) -> float | RewardResult
RewardFn = Callable[[str, str, Mapping[str, Any]], "float | RewardResult"]


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


def _as_float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
