"""Environments of multi-turn (agentic) rollouts: the protocol, built-ins, and the resolver.

``base`` (the protocol and its types), ``registry`` (``rollout.environment`` -> class),
``tool_env`` (environments whose model calls tools), and the built-ins: ``brighter``
(which of two images, shown one per turn, was brighter: a vision model's), ``calculator``
(addition with a calculator tool), ``guess_number`` (a feedback game), ``python_math``
(math with a Python interpreter tool). The episode driver is ``rollout.multiturn``.

Must not: import torch, the engines or the trainer.
"""

from relax_hpc.rollout.envs.base import (
    Action,
    Environment,
    EnvRuntime,
    Observation,
    StepResult,
    episode_seed,
)
from relax_hpc.rollout.envs.registry import BUILTIN_ENVIRONMENTS, resolve_environment

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "Action",
    "EnvRuntime",
    "Environment",
    "Observation",
    "StepResult",
    "episode_seed",
    "resolve_environment",
]
