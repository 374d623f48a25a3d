"""``brighter``: two images, one per turn; which one was brighter? (images across turns)

``reset`` shows image A (a flat grey square) as the whole prompt; whatever the model says
to it, the next observation shows image B and asks ``which was brighter, A or B?``. The
last turn's first ``A`` or ``B`` is the answer: reward 1 if it names the brighter image,
else 0. The answer needs both images, so a policy can only learn it if the first turn's
image reaches the second turn's prompt: the smallest check that visual context is carried
across turns (a vision model only: ``model.modality=vision``).

The two grey levels come from the episode seed (every sample of a group sees the same pair
when the row has a ``seed`` column, as a group baseline needs), at least ``min_gap`` apart.

Must not: import torch or the engines.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_hpc.rollout.envs.base import Action, Environment, Observation, StepResult

_ANSWER = re.compile(r"\b([AB])\b")


class BrighterEnv(Environment):
    @dataclass(frozen=True)
    class Options:
        size_px: int = 32  # side of each square image
        min_gap: int = 40  # smallest difference of the two grey levels (0-255)

        def __post_init__(self) -> None:
            if self.size_px < 1 or not 1 <= self.min_gap <= 200:
                raise ValueError(
                    f"size_px must be >= 1 and min_gap in [1, 200], got {self.size_px}, "
                    f"{self.min_gap}"
                )

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        rng = random.Random(int(row["seed"]) if "seed" in row else seed)
        first = rng.randint(0, 255 - self.options.min_gap)
        second = rng.randint(first + self.options.min_gap, 255)
        self.levels = (first, second) if rng.random() < 0.5 else (second, first)
        return _show("Image A:", self._image(0), "Remember it.")

    def step(self, action: Action) -> StepResult:
        if action.turn == 0:
            return StepResult(_show("Image B:", self._image(1), "Which was brighter, A or B?"))
        match = _ANSWER.search(action.text)
        brighter = "A" if self.levels[0] > self.levels[1] else "B"
        answer = match.group(1) if match else None
        return StepResult(
            reward=float(answer == brighter), done=True, info={"answered": answer is not None}
        )

    def _image(self, index: int) -> np.ndarray:
        size = self.options.size_px
        return np.full((size, size, 3), self.levels[index], dtype=np.uint8)


def _show(before: str, image: np.ndarray, after: str) -> Observation:
    content = [{"type": "text", "text": before}, {"type": "image"}, {"type": "text", "text": after}]
    return Observation(({"role": "user", "content": content},), images=(image,))
