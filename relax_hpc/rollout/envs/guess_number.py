"""``guess_number``: find a secret integer from "higher" / "lower" replies.

Each model turn is a guess (the first integer in its text); the environment answers with a
user message, ``higher``, ``lower`` or ``say a number``. A right guess ends the episode
with reward ``1 - turn_penalty * turns_before_it`` (binary search earns the most); running
out of turns (the driver's ``max_turns``) ends it with 0. The secret is the row's
``secret`` (every sample of a group plays the same game, as a group baseline needs); a row
without one draws it from the episode seed.

``GuessNumberTask`` is the matching synthetic dataset: row ``i`` plays for a secret drawn
from ``(split_seed, i)``, with the prompt ``"guess 1-20:"``.

Must not: import torch or the engines.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.rollout.envs.base import Action, Environment, Observation, StepResult

_INTEGER = re.compile(r"-?\d+")


class GuessNumberEnv(Environment):
    @dataclass(frozen=True)
    class Options:
        low: int = 1
        high: int = 20
        turn_penalty: float = 0.1  # per wrong guess before the right one

        def __post_init__(self) -> None:
            if self.low >= self.high:
                raise ValueError(f"low ({self.low}) must be below high ({self.high})")

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        if "secret" in row:
            self.secret = int(row["secret"])
        else:
            self.secret = random.Random(seed).randint(self.options.low, self.options.high)
        self.wrong_guesses = 0
        return None

    def step(self, action: Action) -> StepResult:
        match = _INTEGER.search(action.text)
        if match is None:
            self.wrong_guesses += 1
            return StepResult(_reply("say a number"), info={"invalid_guesses": 1})
        guess = int(match.group())
        if guess == self.secret:
            reward = max(0.0, 1.0 - self.options.turn_penalty * self.wrong_guesses)
            return StepResult(reward=reward, done=True, info={"found": True})
        self.wrong_guesses += 1
        return StepResult(_reply("higher" if guess < self.secret else "lower"))


def _reply(text: str) -> Observation:
    return Observation(({"role": "user", "content": text},))


class GuessNumberTask(Sequence[dict[str, Any]]):
    """``size`` games with secrets in ``[low, high]``: rows ``{"prompt", "answer", "secret"}``."""

    def __init__(self, size: int, low: int = 1, high: int = 20, split_seed: int = 0) -> None:
        self.size, self.low, self.high, self.split_seed = size, low, high, split_seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        if not 0 <= index < self.size:
            raise IndexError(index)
        secret = random.Random(f"guess_number:{self.split_seed}:{index}").randint(
            self.low, self.high
        )
        return {"prompt": f"guess {self.low}-{self.high}:", "answer": str(secret), "secret": secret}
