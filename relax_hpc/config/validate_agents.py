"""Checks of the multi-turn (agentic) rollout fields and of the tasks they run on.

Whether ``rollout.environment`` names an importable class with the declared options is
checked by ``relax_hpc.resolve`` (it imports the class); these rules look at values and at
how the fields fit the rest of the run. Each raises ``ConfigError`` naming the field.
"""

from __future__ import annotations

import math

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.rewards import COMPOSITE
from relax_hpc.config.schema import RunConfig


def check_agents(cfg: RunConfig) -> None:
    rollout = cfg.rollout
    if rollout.environment is None:
        if rollout.environment_options:
            raise ConfigError(
                "rollout.environment_options",
                "options are set but rollout.environment is null, so nothing reads them; "
                "set rollout.environment or drop the options",
            )
    else:
        _check_environment_rewards(cfg)
    for name in ("max_turns", "max_episode_tokens"):
        if getattr(rollout, name) < 1:
            raise ConfigError(f"rollout.{name}", f"must be >= 1, got {getattr(rollout, name)}")
    _positive_seconds("rollout.episode_timeout_s", rollout.episode_timeout_s)
    tools = rollout.tools
    _positive_seconds("rollout.tools.timeout_s", tools.timeout_s)
    for name, value, least in (
        ("num_workers", tools.num_workers, 1),
        ("max_output_bytes", tools.max_output_bytes, 1),
        ("memory_mb", tools.memory_mb, 0),
    ):
        if value < least:
            raise ConfigError(f"rollout.tools.{name}", f"must be >= {least}, got {value}")
    _check_task(cfg)


def _check_environment_rewards(cfg: RunConfig) -> None:
    """An environment rewards its episodes itself: reward services would run for nothing."""
    why = "rollout.environment rewards its own episodes (its step rewards are the reward)"
    if cfg.judge is not None:
        raise ConfigError("judge", f"{why}; a judge would not be used: set judge=none")
    if cfg.rollout.reward == COMPOSITE:
        raise ConfigError("rollout.reward", f"{why}; composite rewards are not used with it")
    for section in ("reward_models", "endpoints", "eval_reward"):
        if getattr(cfg.rewards, section):
            raise ConfigError(f"rewards.{section}", f"{why}; drop rewards.{section}")


def _check_task(cfg: RunConfig) -> None:
    data = cfg.data
    if data.kind == "guess_number":
        low_high = list(data.guess_range)
        if len(low_high) != 2 or not low_high[0] < low_high[1]:
            raise ConfigError(
                "data.guess_range", f"must be [low, high] with low < high, got {low_high}"
            )


def _positive_seconds(field: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(field, f"must be > 0 seconds, got {value!r}")
