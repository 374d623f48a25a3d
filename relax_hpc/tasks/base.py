"""What a built-in task is: the one object that knows its data, its reward and its warm start.

A task's module (``tasks.addition``, ``tasks.calculator``, ...) defines one ``Task`` (its
``TASK``) beside the recipe of its warm start; ``tasks.registry`` lists them. The roles
never name a recipe: they ask the task of their config (``registry.policy_task``, or the
name in ``judge.warm_start`` / ``rewards.reward_models.<name>.warm_start``) for
``task.warm_start(model_cfg, data_cfg, cache_dir)``.

Must not: import torch or transformers (a task's module does, when it is loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from relax_hpc.config.schema import DataConfig, ModelConfig

# (the model's config, the run's data config, the cache folder) -> the warm-started HF folder
WarmStart = Callable[[ModelConfig, DataConfig, Path], Path]
# (the run's data config, "train" | "eval", split_seed) -> the split's rows (prompt, answer, ...)
Rows = Callable[[DataConfig, str, int], Sequence[Mapping[str, Any]]]
# warmstart.json (what the warm start measured of itself) -> that, in words, for the log
Quality = Callable[[Mapping[str, Any]], str]
# Which model of a run a task's warm start trains.
WarmStarts = Literal["policy", "judge", "reward_model"]


@dataclass(frozen=True)
class Task:
    """One built-in task."""

    name: str  # its name in tasks.registry.TASKS
    data_kind: str  # the data.kind whose prompts it poses
    warm_start: WarmStart  # trains (once, cached) the model it warm-starts
    warm_starts: WarmStarts = "policy"
    reward: str | None = None  # the built-in reward (rollout/rewards) that scores it
    environment: str | None = None  # the built-in environment its episodes run in
    quality: Quality = lambda _: "(trained once, cached)"
    # The rows of its data.kind (data/datasets.py asks tasks.registry.data_task); None for a
    # task that poses another task's prompts (a verifier, a scorer, the calculator).
    rows: Rows | None = None
