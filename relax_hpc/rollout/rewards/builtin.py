"""The built-in rule rewards, each the convention of a published recipe.

| name | recipe | score |
|---|---|---|
| ``exact_match`` | the synthetic task | 1 / 0 |
| ``math`` | math-verify on the last ``\\boxed{}`` or ``Answer:`` line | 1 / 0 |
| ``boxed_math`` | math-verify on the last ``\\boxed{}`` only (verl's and Relax's math recipes) | 1 / 0 |
| ``dapo_math`` | DAPO: the last ``Answer:`` line of the last 300 characters, Minerva-normalised, compared as a string | 1 / -1 |
| ``multiple_choice`` | the chosen letter (A-J) against the reference letter or option | 1 / 0 |
| ``geo3k`` | verl's Geometry3K recipe: 0.9 x accuracy (last ``\\boxed{}``, math-verify) + 0.1 x format (``<think>...</think>`` then ``\\boxed{}``) | 0 .. 1 |
| ``format`` | states a final answer and closes ``<think>`` | 1 / 0 |

Every reward has the signature ``fn(completion, answer, metadata) -> RewardResult`` and
puts what it extracted into ``details["extracted"]``. Rewards above 0.5 count as correct in
``reward/accuracy`` and the held-out accuracy; DAPO's -1 for a wrong answer is kept as
DAPO scores it (the group-normalised advantage of GRPO is the same for 1/0 and 1/-1).

Must not: import torch, the engines or the trainer; rewards see text, not tokens.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from relax_hpc.rollout.rewards.extract import (
    as_boxed,
    choice_letter,
    final_answer,
    last_answer_line,
    last_boxed,
    minerva_normalize,
    reference_letter,
)
from relax_hpc.rollout.rewards.result import RewardResult

GEO3K_FORMAT_WEIGHT = 0.1  # verl's geo3k recipe: 0.9 accuracy + 0.1 format
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def exact_match(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """1 if the completion equals the answer up to surrounding whitespace, else 0."""
    return RewardResult(float(completion.strip() == str(answer).strip()))


def math_equal(predicted: str | None, answer: str) -> bool:
    """Whether two final answers are mathematically equal (math-verify; False if unparsable)."""
    if predicted is None:
        return False
    from math_verify import parse, verify  # imported here: slow, and only math rewards need it

    gold = parse(as_boxed(str(answer)))
    guess = parse(as_boxed(predicted))
    return bool(gold) and bool(guess) and verify(gold, guess)


def math_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """1 if the final answer (last ``\\boxed{}``, else ``Answer:`` line) equals the reference."""
    extracted = final_answer(completion)
    return RewardResult(float(math_equal(extracted, answer)), {"extracted": extracted})


def boxed_math_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """1 if the last ``\\boxed{}`` is mathematically equal to the reference, else 0."""
    extracted = last_boxed(completion)
    return RewardResult(float(math_equal(extracted, answer)), {"extracted": extracted})


def dapo_math_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """DAPO's reward: 1 if the last ``Answer:`` line matches the reference after Minerva's
    normalisation, else -1 (a missing answer is wrong)."""
    line = last_answer_line(completion)
    extracted = minerva_normalize(line) if line is not None else None
    correct = extracted is not None and extracted == minerva_normalize(str(answer))
    return RewardResult(1.0 if correct else -1.0, {"extracted": extracted, "acc": correct})


def multiple_choice_reward(
    completion: str, answer: str, metadata: Mapping[str, Any]
) -> RewardResult:
    """1 if the completion's final choice is the reference choice, else 0."""
    reference = reference_letter(answer, metadata)
    if reference is None:
        raise ValueError(
            f"multiple_choice: the reference answer {answer!r} is neither a letter A-J nor "
            "one of the row's options (metadata 'options' or 'choices')"
        )
    chosen = choice_letter(completion)
    return RewardResult(float(chosen == reference), {"extracted": chosen})


def geo3k_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """verl's Geometry3K reward: 0.9 x (last boxed == answer) + 0.1 x (think, then boxed)."""
    extracted = last_boxed(completion)
    accurate = math_equal(extracted, answer)
    formatted = _GEO3K_FORMAT.fullmatch(completion.strip()) is not None
    score = (1 - GEO3K_FORMAT_WEIGHT) * accurate + GEO3K_FORMAT_WEIGHT * formatted
    return RewardResult(score, {"extracted": extracted, "acc": accurate, "format": formatted})


def format_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> RewardResult:
    """1 if the completion states a final answer (boxed or ``Answer:``) and closes any ``<think>``."""
    has_answer = final_answer(completion) is not None
    think_closed = "<think>" not in completion or "</think>" in completion.split("<think>")[-1]
    details = {"has_answer": has_answer, "think_closed": think_closed}
    return RewardResult(float(has_answer and think_closed), details)
