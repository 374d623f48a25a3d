"""The built-in verifiable task of grpo_tiny: add two numbers, answer LSD-first.

A prompt is ``"37+48="`` and its answer is the sum written least-significant digit first
(``85`` -> ``"58"``), which a 2-layer model can learn because each answer digit then depends
only on digits already seen. Operands run over ``0 .. 10**digits - 1``; every ordered pair is
one example. A fixed ``split_seed`` picks ``eval_size`` pairs as the held-out split; the train
split is every other pair, in pair order. Both are pure functions of (digits, eval_size,
split_seed, index), so every process and every rerun sees the same examples.

The *sloppy teacher* writes the supervised warm start's targets: it forgets each carry with
probability ``forget_carry_prob``. A model that has converged on it puts most mass on the
carry-less (often wrong) answer and some on the right one, which gives RL a weak base that
still samples correct answers.

Must not: import torch or a tokenizer; the dataset layer turns rows into token ids.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from typing import Any, overload

TASK_NAME = "synthetic_addition"


def lsd_first(number: int) -> str:
    """``85`` -> ``"58"``."""
    return str(number)[::-1]


def addition_prompt(a: int, b: int) -> str:
    return f"{a}+{b}="


def sloppy_answer(a: int, b: int, forget_carry_prob: float, rng: random.Random) -> str:
    """The sum LSD-first, computed digit by digit, dropping each carry with the given probability.

    A dropped final carry drops the leading digit. One ``rng.random()`` call per carry.
    """
    digits: list[str] = []
    carry = 0
    while a or b or carry:
        total = a % 10 + b % 10 + carry
        digits.append(str(total % 10))
        carry = total // 10
        if carry and rng.random() < forget_carry_prob:
            carry = 0
        a, b = a // 10, b // 10
    return "".join(digits) or "0"


# The wrong answers a verifier (the judge of grpo_tiny_judge) is trained to reject: what a
# weak policy writes. ``sloppy`` forgets carries, ``digit`` changes one digit, ``length``
# drops or adds a digit, ``reversed`` writes the sum most-significant digit first.
CANDIDATE_MISTAKES = ("sloppy", "digit", "length", "reversed", "random")


def wrong_candidate(a: int, b: int, mistake: str, rng: random.Random) -> str:
    """A plausible wrong answer to ``a+b`` (may equal the right one; callers retry)."""
    truth = lsd_first(a + b)
    if mistake == "sloppy":
        return sloppy_answer(a, b, 1.0, rng)
    if mistake == "digit":
        position = rng.randrange(len(truth))
        return truth[:position] + str(rng.randrange(10)) + truth[position + 1 :]
    if mistake == "length":
        if len(truth) > 1 and rng.random() < 0.5:
            position = rng.randrange(len(truth))
            return truth[:position] + truth[position + 1 :]
        return truth + str(rng.randrange(10))
    if mistake == "reversed":
        return truth[::-1]
    if mistake == "random":
        return str(rng.randrange(10 ** rng.randint(1, len(truth) + 1)))
    raise ValueError(f"unknown mistake {mistake!r}; known: {', '.join(CANDIDATE_MISTAKES)}")


def verification_candidate(
    a: int, b: int, rng: random.Random, correct_share: float = 0.5
) -> tuple[str, bool]:
    """A candidate answer to ``a+b`` and whether it is right: the verifier's training row."""
    truth = lsd_first(a + b)
    if rng.random() < correct_share:
        return truth, True
    while True:
        candidate = wrong_candidate(a, b, rng.choice(CANDIDATE_MISTAKES), rng)
        if candidate != truth:
            return candidate, False


class AdditionSplit(Sequence[dict[str, Any]]):
    """One split as a lazy sequence of rows ``{"prompt", "answer", "a", "b"}``."""

    def __init__(self, pair_indices: Sequence[int] | None, task: AdditionTask) -> None:
        self._pairs = pair_indices  # None: every pair not held out (the train split)
        self._task = task

    def __len__(self) -> int:
        if self._pairs is None:
            return self._task.num_pairs - len(self._task.eval_pair_indices)
        return len(self._pairs)

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        pair = self._task.train_pair_index(index) if self._pairs is None else self._pairs[index]
        return self._task.row(pair)


class AdditionTask:
    """All ordered pairs of ``digits``-digit operands, split into train and held-out eval."""

    def __init__(self, digits: int = 2, eval_size: int = 256, split_seed: int = 0) -> None:
        if digits < 1:
            raise ValueError(f"data.digits must be >= 1, got {digits}")
        self.digits = digits
        self.base = 10**digits
        self.num_pairs = self.base * self.base
        if not 0 < eval_size < self.num_pairs // 2:
            raise ValueError(f"data.eval_size must be in 1..{self.num_pairs // 2 - 1}")
        held_out = random.Random(f"{TASK_NAME}:{digits}:{split_seed}").sample(
            range(self.num_pairs), eval_size
        )
        self.eval_pair_indices: tuple[int, ...] = tuple(held_out)
        self._eval_sorted = sorted(held_out)
        self.train = AdditionSplit(None, self)
        self.eval = AdditionSplit(self.eval_pair_indices, self)

    def operands(self, pair_index: int) -> tuple[int, int]:
        return divmod(pair_index, self.base)

    def row(self, pair_index: int) -> dict[str, Any]:
        a, b = self.operands(pair_index)
        return {"prompt": addition_prompt(a, b), "answer": lsd_first(a + b), "a": a, "b": b}

    def train_pair_index(self, index: int) -> int:
        """The ``index``-th pair that is not held out (pairs in increasing order)."""
        # The least fixed point of p = index + #(held-out pairs <= p), reached from below; it is
        # never a held-out pair (else p - 1 would be a smaller fixed point).
        pair = index
        while (moved := index + bisect.bisect_right(self._eval_sorted, pair)) != pair:
            pair = moved
        return pair

    def is_eval_pair(self, pair_index: int) -> bool:
        position = bisect.bisect_left(self._eval_sorted, pair_index)
        return position < len(self._eval_sorted) and self._eval_sorted[position] == pair_index
