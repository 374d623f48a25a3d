"""Rewards: the built-in registry, the one extension point, and fault-tolerant scoring.

A reward function has the signature::

    def my_reward(completion: str, answer: str, metadata: Mapping[str, Any]) -> float | RewardResult

``completion`` is the generated text (special tokens removed), ``answer`` the dataset's
reference answer, ``metadata`` the prompt row's other columns. ``rollout.reward`` names a
built-in (``registry.REWARDS``: see ``builtin`` for each recipe's convention) or
``"package.module:function"``. Modules: ``builtin`` (rule rewards), ``extract`` (finding the
final answer), ``registry`` (names -> functions, the one place names resolve), ``scorer``
(child-process scoring with timeouts), ``result`` (``RewardResult``).

Must not: import torch, the engines or the trainer; rewards see text, not tokens.
"""

from relax_hpc.rollout.rewards.builtin import (
    boxed_math_reward,
    dapo_math_reward,
    exact_match,
    format_reward,
    geo3k_reward,
    math_reward,
    multiple_choice_reward,
)
from relax_hpc.rollout.rewards.extract import final_answer, last_boxed, minerva_normalize
from relax_hpc.rollout.rewards.registry import (
    REWARDS,
    RewardNameError,
    resolve_reward,
    reward_names,
)
from relax_hpc.rollout.rewards.result import RewardFn, RewardResult, call_reward
from relax_hpc.rollout.rewards.scorer import RewardScorer, build_reward, score_one

__all__ = [
    "REWARDS",
    "RewardFn",
    "RewardNameError",
    "RewardResult",
    "RewardScorer",
    "boxed_math_reward",
    "build_reward",
    "call_reward",
    "dapo_math_reward",
    "exact_match",
    "final_answer",
    "format_reward",
    "geo3k_reward",
    "last_boxed",
    "math_reward",
    "minerva_normalize",
    "multiple_choice_reward",
    "resolve_reward",
    "reward_names",
    "score_one",
]
