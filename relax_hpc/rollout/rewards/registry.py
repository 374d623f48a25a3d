"""Reward names: the one place where ``rollout.reward`` resolves to a function.

A name is a built-in (``REWARDS``) or, as the one extension point for user code,
``"package.module:function"`` (importable where the job runs, e.g. via ``PYTHONPATH`` in
``cluster.setup``). ``submit`` resolves the name before anything is submitted; the rollout
resolves it again in its reward process.

Must not: import torch, the engines or the trainer.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from relax_hpc.plugins import PluginError, import_object
from relax_hpc.rollout.rewards.builtin import (
    boxed_math_reward,
    dapo_math_reward,
    exact_match,
    format_reward,
    geo3k_reward,
    math_reward,
    multiple_choice_reward,
)
from relax_hpc.rollout.rewards.result import RewardFn

if TYPE_CHECKING:
    from relax_hpc.config.rewards import RewardsConfig

REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_reward,
    "boxed_math": boxed_math_reward,
    "dapo_math": dapo_math_reward,
    "multiple_choice": multiple_choice_reward,
    "geo3k": geo3k_reward,
    "format": format_reward,
}


class RewardNameError(ValueError):
    """``rollout.reward`` names nothing that can be called; the message says the fix."""


def reward_names() -> tuple[str, ...]:
    return tuple(REWARDS)


@functools.cache
def resolve_reward(spec: str) -> RewardFn:
    """A registry name or ``module:function``; ``RewardNameError`` naming ``rollout.reward``."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise RewardNameError(
            f"rollout.reward: {spec!r} is not a built-in reward (known: {', '.join(REWARDS)}); "
            "use one of them, or your own function as module:function"
        )
    try:
        return import_object(spec, "rollout.reward", "function")
    except PluginError as err:
        raise RewardNameError(str(err)) from None


# What a reward part name stands for (config/rewards.py says how names are looked up).
JUDGE, REWARD_MODEL, ENDPOINT, RULE = "judge", "reward_model", "endpoint", "rule"


def part_kind(name: str, rewards: RewardsConfig, has_judge: bool, field: str) -> str:
    """``judge``, ``reward_model``, ``endpoint`` or ``rule`` (a resolvable reward function);
    ``RewardNameError`` naming ``field`` when ``name`` is none of them."""
    if name == JUDGE:
        if not has_judge:
            raise RewardNameError(
                f"{field}: 'judge' needs a judge; choose one with judge=<name> (configs/judge/) "
                "or set the judge section"
            )
        return JUDGE
    if name in rewards.reward_models:
        return REWARD_MODEL
    if name in rewards.endpoints:
        return ENDPOINT
    try:
        resolve_reward(name)
    except RewardNameError as err:
        others = [JUDGE, *rewards.reward_models, *rewards.endpoints]
        text = str(err).replace("rollout.reward", field, 1)
        raise RewardNameError(f"{text} (other reward parts: {', '.join(others)})") from None
    return RULE
