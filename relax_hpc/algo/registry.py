"""The algorithm registry: an AlgoConfig resolved once into functions and flags.

``resolve(cfg)`` validates the config, fills the algorithm's defaults (estimator, policy
loss, aggregation, whitening), binds the hyperparameters and returns an ``AlgorithmSpec``.
The trainer and the cross-group config checks read the spec's flags; nobody else branches on
algorithm names.

Must not: import anything outside algo.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from relax_hpc.algo import advantages as adv
from relax_hpc.algo import losses
from relax_hpc.config.algo import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    POLICY_LOSSES,
    AlgoConfig,
)


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read; ``reward_kl_BT`` is the KL-in-reward penalty or None;
    ``scored_B`` False for samples whose reward failed (None: all scored)."""

    scores_B: Tensor
    response_mask_BT: Tensor
    group_ids_B: Tensor | None = None
    values_BT: Tensor | None = None
    reward_kl_BT: Tensor | None = None
    scored_B: Tensor | None = None


AdvantageFn = Callable[[AdvantageInputs], tuple[Tensor, Tensor]]
PolicyLossFn = Callable[[Tensor, Tensor, Tensor, Tensor], losses.LossAndMetrics]


@dataclass(frozen=True)
class AlgorithmSpec:
    """A resolved algorithm: bound functions plus what the run must provide for them.

    ``estimate_advantages(inputs) -> (advantages_BT, returns_BT)``;
    ``policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, response_mask_BT)
    -> (loss_BT, metrics)``.
    """

    config: AlgoConfig  # every null choice filled with the algorithm's default
    estimate_advantages: AdvantageFn
    policy_loss: PolicyLossFn
    loss_agg_mode: str
    normalize_advantages: bool
    needs_critic: bool  # values and a value loss (GAE)
    needs_reference: bool  # reference-model log-probs (KL in reward or in loss)
    needs_teacher: bool  # teacher log-probs (on-policy distillation)
    needs_rollout_logprobs: bool  # the rollout engine's log-probs (TIS, or used as old)
    group_based: bool  # needs n_samples_per_prompt >= 2

    @property
    def name(self) -> str:
        return self.config.name


def resolve(cfg: AlgoConfig) -> AlgorithmSpec:
    """Validate ``cfg`` and bind it to its estimator and loss (raises ValueError if invalid)."""
    cfg.validate()
    resolved = cfg.with_algorithm_defaults()
    estimator = _ESTIMATORS[resolved.advantage_estimator]
    loss_fn, loss_kwargs = _POLICY_LOSSES[resolved.policy_loss]
    return AlgorithmSpec(
        config=resolved,
        estimate_advantages=functools.partial(estimator, resolved),
        policy_loss=functools.partial(loss_fn, **loss_kwargs(resolved)),
        loss_agg_mode=resolved.loss_agg_mode,
        normalize_advantages=resolved.normalize_advantages,
        needs_critic=resolved.advantage_estimator == "gae",
        needs_reference=resolved.kl_in_reward_coef > 0 or resolved.kl_loss_coef > 0,
        needs_teacher=resolved.opd_coef > 0,
        needs_rollout_logprobs=resolved.tis_mode != "none" or resolved.use_rollout_logprobs,
        group_based=resolved.is_group_based(),
    )


def _gae(cfg: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    if x.values_BT is None:
        raise ValueError("the gae estimator needs values_BT from the critic")
    rewards_BT = adv.outcome_token_rewards(x.scores_B, x.response_mask_BT, x.reward_kl_BT)
    return adv.gae_advantages(rewards_BT, x.values_BT, x.response_mask_BT, cfg.gamma, cfg.lam)


def _reinforce_pp(cfg: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    rewards_BT = adv.outcome_token_rewards(x.scores_B, x.response_mask_BT, x.reward_kl_BT)
    return adv.reinforce_pp_advantages(rewards_BT, x.response_mask_BT, cfg.gamma)


def _group_estimator(
    per_group: Callable[..., Tensor],
) -> Callable[[AlgoConfig, AdvantageInputs], tuple[Tensor, Tensor]]:
    """Adapt an outcome estimator; KL-in-reward is folded into the sample's score."""

    def estimate(cfg: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, Tensor]:
        if x.group_ids_B is None:
            raise ValueError(f"the {cfg.advantage_estimator} estimator needs group_ids_B")
        scores_B = adv.kl_shaped_scores(x.scores_B, x.response_mask_BT, x.reward_kl_BT)
        advantages_BT = per_group(scores_B, x.response_mask_BT, x.group_ids_B, scored_B=x.scored_B)
        return advantages_BT, advantages_BT  # returns = advantages for outcome estimators

    return estimate


_ESTIMATORS: dict[str, Callable[[AlgoConfig, AdvantageInputs], tuple[Tensor, Tensor]]] = {
    "gae": _gae,
    "reinforce_pp": _reinforce_pp,
    "grpo": _group_estimator(adv.grpo_advantages),
    "dr_grpo": _group_estimator(adv.dr_grpo_advantages),
    "rloo": _group_estimator(adv.rloo_advantages),
    "reinforce_pp_baseline": _group_estimator(adv.reinforce_pp_baseline_advantages),
}
assert set(_ESTIMATORS) - {"gae", "reinforce_pp"} == GROUP_ESTIMATORS

_POLICY_LOSSES: dict[str, tuple[Callable[..., Any], Callable[[AlgoConfig], dict[str, Any]]]] = {
    "ppo_clip": (
        losses.ppo_clip_loss,
        lambda c: {"clip_low": c.clip_low, "clip_high": c.clip_high, "dual_clip_c": c.dual_clip_c},
    ),
    "gspo": (
        losses.gspo_loss,
        lambda c: {"clip_low": c.gspo_clip_low, "clip_high": c.gspo_clip_high},
    ),
    "sapo": (
        losses.sapo_loss,
        lambda c: {"tau_pos": c.sapo_tau_pos, "tau_neg": c.sapo_tau_neg},
    ),
    "cispo": (
        losses.cispo_loss,
        lambda c: {"clip_low": c.cispo_clip_low, "clip_high": c.cispo_clip_high},
    ),
    "reinforce": (losses.reinforce_loss, lambda c: {}),
    "m2po": (
        losses.m2po_loss,
        lambda c: {
            "budget": c.m2po_budget,
            "min_clip_low": c.m2po_min_clip_low,
            "min_clip_high": c.m2po_min_clip_high,
        },
    ),
}
# Submit checks names against config/algo.py alone (no torch there): every name it accepts
# must be bound here, and nothing bound here may be unreachable from a config.
assert set(_ESTIMATORS) == set(ADVANTAGE_ESTIMATORS), "bind every ADVANTAGE_ESTIMATORS name"
assert set(_POLICY_LOSSES) == set(POLICY_LOSSES), "bind every POLICY_LOSSES name"
