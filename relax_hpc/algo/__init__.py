"""Algorithm library: pure tensor math for RL post-training over padded ``[B, T]`` batches.

What the trainer calls (see docs/algorithms.md for the formulas)::

    spec = resolve(cfg)                       # AlgoConfig -> AlgorithmSpec, once per run
    advantages_BT, returns_BT = compute_advantages(
        spec, rewards_B, response_mask_BT, group_ids_B,
        values_BT=None, old_logprobs_BT=None, ref_logprobs_BT=None, teacher_logprobs_BT=None,
        scored_B=None)                        # False: the sample's reward failed
    trained_B = trained_samples(spec, scored_B, group_ids_B)   # the rest: mask out of the loss
    loss, metrics = actor_loss(
        spec, logprobs_BT, old_logprobs_BT, advantages_BT, response_mask_BT,
        rollout_logprobs_BT=None, ref_logprobs_BT=None, entropy_BT=None,
        teacher_logprobs_BT=None, global_num_tokens=None, global_num_seqs=None, dp_size=1)
    loss, metrics = value_loss(
        spec, values_BT, old_values_BT, returns_BT, response_mask_BT,
        global_num_tokens=None, global_num_seqs=None, dp_size=1)

``spec.needs_critic / needs_reference / needs_teacher / needs_rollout_logprobs /
group_based`` say which inputs a run must produce. ``response_mask_BT`` is 1 on trainable
tokens; interior zeros (observation tokens) and all-zero rows (empty responses) are allowed,
and whatever sits in masked positions (garbage, NaN) never reaches a result. The building
blocks (estimators, per-token losses, KL estimators, TIS, aggregation, entropy) are exported
too and are usable on their own.

Must not: import anything of relax_hpc outside this package, Hydra/OmegaConf, or
torch.distributed (data-parallel counts are arguments); do I/O. Runs on CPU.
"""

from relax_hpc.algo.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    gae_advantages,
    grpo_advantages,
    kl_shaped_scores,
    outcome_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from relax_hpc.algo.aggregation import aggregate, masked_mean, masked_sum, masked_whiten
from relax_hpc.algo.api import (
    actor_loss,
    compute_advantages,
    dropped_groups,
    trained_samples,
    value_loss,
)
from relax_hpc.algo.distillation import opd_divergence, opd_loss_per_token, opd_shaped_advantages
from relax_hpc.algo.kl import kl_penalty, reward_kl_penalty
from relax_hpc.algo.losses import (
    cispo_loss,
    clipped_value_loss,
    entropy_from_logits,
    gspo_loss,
    m2po_clip_margins,
    m2po_loss,
    ppo_clip_loss,
    reinforce_loss,
    sapo_loss,
)
from relax_hpc.algo.registry import AdvantageInputs, AlgorithmSpec, resolve
from relax_hpc.algo.tis import truncated_is_weights
from relax_hpc.config.algo import AlgoConfig

__all__ = [
    "AdvantageInputs",
    "AlgoConfig",
    "AlgorithmSpec",
    "actor_loss",
    "aggregate",
    "cispo_loss",
    "clipped_value_loss",
    "compute_advantages",
    "discounted_returns",
    "dropped_groups",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty",
    "kl_shaped_scores",
    "m2po_clip_margins",
    "m2po_loss",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "opd_divergence",
    "opd_loss_per_token",
    "opd_shaped_advantages",
    "outcome_token_rewards",
    "ppo_clip_loss",
    "reinforce_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "resolve",
    "reward_kl_penalty",
    "rloo_advantages",
    "sapo_loss",
    "trained_samples",
    "truncated_is_weights",
    "value_loss",
]
