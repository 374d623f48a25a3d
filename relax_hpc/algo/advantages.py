"""Advantage estimators and advantage shaping, over padded ``[B, T]`` batches.

Inputs: ``scores_B`` (one outcome reward per sample), ``response_mask_BT`` (1 = trainable
token; interior zeros are observation tokens, an all-zero row an empty response) and
``group_ids_B`` (samples with the same id are completions of one prompt). Outputs are 0
outside the mask. Everything here runs without gradient.

Whole-batch statistics (GRPO groups, REINFORCE++ normalisation, whitening) are taken over
what is passed in: call these on the whole step batch, with complete groups, before it is
split across data-parallel ranks.

``scored_B`` (bool, optional; None = every sample scored): False for a sample whose reward
failed (a judge that timed out, an endpoint that was down): its score says nothing, so it
enters no statistic and gets advantage 0. A group left with fewer than
``MIN_SCORED_PER_GROUP`` scored samples has no baseline: all of its samples get 0
(``trained_samples`` says which samples remain; the trainer masks the rest out of the loss).

Must not: call torch.distributed, do I/O, or import anything outside algo.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_hpc.algo.aggregation import masked_sum, masked_whiten, select

# Added to the group std (not inside a sqrt), so an all-equal group gives 0, not NaN.
GRPO_STD_EPS = 1e-6
# A baseline of one scored sample is that sample itself: its group teaches nothing.
MIN_SCORED_PER_GROUP = 2


def trained_samples(scored_B: Tensor | None, group_ids_B: Tensor) -> Tensor:
    """bool ``[B]``: scored samples of groups with at least ``MIN_SCORED_PER_GROUP`` scored
    samples, the ones group statistics and the loss use."""
    inverse_B, counts_G = _group_index(group_ids_B)
    if scored_B is None:
        return torch.ones(inverse_B.shape, dtype=torch.bool, device=inverse_B.device)
    scored_B = scored_B.bool().to(inverse_B.device)
    scored_G = torch.zeros_like(counts_G).index_add_(0, inverse_B, scored_B.long())
    return scored_B & (scored_G[inverse_B] >= MIN_SCORED_PER_GROUP)


def num_dropped_groups(scored_B: Tensor | None, group_ids_B: Tensor) -> int:
    """Groups left with fewer than ``MIN_SCORED_PER_GROUP`` scored samples."""
    inverse_B, counts_G = _group_index(group_ids_B)
    if scored_B is None:
        return 0
    scored_B = scored_B.bool().to(inverse_B.device)
    scored_G = torch.zeros_like(counts_G).index_add_(0, inverse_B, scored_B.long())
    return int((scored_G < MIN_SCORED_PER_GROUP).sum())


def grpo_advantages(
    scores_B: Tensor,
    response_mask_BT: Tensor,
    group_ids_B: Tensor,
    eps: float = GRPO_STD_EPS,
    scored_B: Tensor | None = None,
) -> Tensor:
    """GRPO: ``(s - mean_g) / (std_g + eps)``, unbiased std of the centred group scores."""
    with torch.no_grad():
        kept_B = trained_samples(scored_B, group_ids_B)
        centred_B = _centred(scores_B, group_ids_B, kept_B)
        inverse_B, _ = _group_index(group_ids_B)
        kept_G = _kept_per_group(kept_B, inverse_B).to(centred_B.dtype)
        sq_sums_G = torch.zeros_like(kept_G).index_add_(0, inverse_B, centred_B**2)
        std_B = torch.sqrt(sq_sums_G / (kept_G - 1).clamp(min=1))[inverse_B]
        normalised_B = (centred_B / (std_B + eps)).to(scores_B.dtype)
        return broadcast_to_tokens(normalised_B, response_mask_BT)


def dr_grpo_advantages(
    scores_B: Tensor, response_mask_BT: Tensor, group_ids_B: Tensor, scored_B: Tensor | None = None
) -> Tensor:
    """Dr. GRPO: ``s - mean_g`` (no std division, which biases towards easy/hard groups)."""
    with torch.no_grad():
        kept_B = trained_samples(scored_B, group_ids_B)
        centred_B = _centred(scores_B, group_ids_B, kept_B).to(scores_B.dtype)
        return broadcast_to_tokens(centred_B, response_mask_BT)


def rloo_advantages(
    scores_B: Tensor, response_mask_BT: Tensor, group_ids_B: Tensor, scored_B: Tensor | None = None
) -> Tensor:
    """RLOO: ``s_i - mean of the others = G / (G - 1) * (s_i - mean_g)`` (G: scored ones)."""
    with torch.no_grad():
        kept_B = trained_samples(scored_B, group_ids_B)
        inverse_B, _ = _group_index(group_ids_B)
        size_B = _kept_per_group(kept_B, inverse_B)[inverse_B].to(torch.float64)
        factor_B = size_B / (size_B - 1).clamp(min=1)
        leave_one_out_B = factor_B * _centred(scores_B, group_ids_B, kept_B)
        return broadcast_to_tokens(leave_one_out_B.to(scores_B.dtype), response_mask_BT)


def reinforce_pp_baseline_advantages(
    scores_B: Tensor, response_mask_BT: Tensor, group_ids_B: Tensor, scored_B: Tensor | None = None
) -> Tensor:
    """REINFORCE++-baseline: ``s - mean_g`` on valid tokens, whitened over the batch (over
    the tokens of trained samples only)."""
    with torch.no_grad():
        kept_B = trained_samples(scored_B, group_ids_B)
        mask_BT = response_mask_BT.bool() & kept_B[:, None].to(response_mask_BT.device)
        centred_BT = dr_grpo_advantages(scores_B, response_mask_BT, group_ids_B, scored_B)
        return masked_whiten(centred_BT, mask_BT)


def reinforce_pp_advantages(
    token_rewards_BT: Tensor, response_mask_BT: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted returns whitened over the batch; returns (advantages, returns)."""
    with torch.no_grad():
        returns_BT = discounted_returns(token_rewards_BT, response_mask_BT, gamma)
        return masked_whiten(returns_BT, response_mask_BT), returns_BT


def discounted_returns(token_rewards_BT: Tensor, response_mask_BT: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}``; masked positions add 0 but keep discounting.

    Continuing through observation tokens keeps the credit of a multi-turn sample's final
    reward on its earlier turns (resetting there would cut it).
    """
    with torch.no_grad():
        rewards_BT = select(token_rewards_BT, response_mask_BT)
        returns_BT = torch.zeros_like(rewards_BT)
        running_B = torch.zeros_like(rewards_BT[:, 0])
        for t in reversed(range(rewards_BT.shape[1])):
            running_B = rewards_BT[:, t] + gamma * running_B
            returns_BT[:, t] = running_B
        return select(returns_BT, response_mask_BT)


def gae_advantages(
    token_rewards_BT: Tensor,
    values_BT: Tensor,
    response_mask_BT: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """GAE; the TD chain skips masked (observation) positions. Returns (advantages, returns).

    ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next`` where "next"
    is the next *valid* position (V = 0 past the end). Returns are the raw ``A + V``;
    whitening, when wanted, is a separate step (``masked_whiten``).
    """
    with torch.no_grad():
        mask_BT = response_mask_BT.bool()
        rewards_BT = select(token_rewards_BT, mask_BT)
        values_BT = select(values_BT, mask_BT)
        advantages_BT = torch.zeros_like(rewards_BT)
        next_value_B = torch.zeros_like(rewards_BT[:, 0])
        next_advantage_B = torch.zeros_like(next_value_B)
        for t in reversed(range(rewards_BT.shape[1])):
            valid_B = mask_BT[:, t]
            delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
            advantage_B = delta_B + gamma * lam * next_advantage_B
            next_value_B = torch.where(valid_B, values_BT[:, t], next_value_B)
            next_advantage_B = torch.where(valid_B, advantage_B, next_advantage_B)
            advantages_BT[:, t] = advantage_B
        advantages_BT = select(advantages_BT, mask_BT)
        return advantages_BT, select(advantages_BT + values_BT, mask_BT)


def outcome_token_rewards(
    scores_B: Tensor, response_mask_BT: Tensor, kl_penalty_BT: Tensor | None = None
) -> Tensor:
    """Token rewards: the score at each sample's last valid token, minus the KL penalty."""
    with torch.no_grad():
        mask_BT = response_mask_BT.bool()
        positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
        last_valid_B = torch.where(mask_BT, positions_BT, -1).max(dim=-1).values
        is_last_BT = positions_BT == last_valid_B[:, None]
        rewards_BT = torch.where(is_last_BT, scores_B[:, None], 0.0)
        if kl_penalty_BT is not None:
            rewards_BT = rewards_BT - select(kl_penalty_BT, mask_BT)
        return select(rewards_BT, mask_BT)


def kl_shaped_scores(
    scores_B: Tensor, response_mask_BT: Tensor, kl_penalty_BT: Tensor | None
) -> Tensor:
    """Outcome score minus the sample's summed KL penalty (KL-in-reward for group estimators)."""
    if kl_penalty_BT is None:
        return scores_B
    with torch.no_grad():
        return scores_B - masked_sum(kl_penalty_BT, response_mask_BT, dim=-1)


def broadcast_to_tokens(per_sample_B: Tensor, response_mask_BT: Tensor) -> Tensor:
    """Copy one value per sample onto its valid tokens."""
    return select(per_sample_B[:, None].expand(response_mask_BT.shape), response_mask_BT)


def _group_index(group_ids_B: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sample group index and per-group sizes; groups of one sample are rejected."""
    _, inverse_B, counts_G = torch.unique(group_ids_B, return_inverse=True, return_counts=True)
    if bool((counts_G < 2).any()):
        raise ValueError(
            "a group holds a single sample; a group baseline needs n_samples_per_prompt >= 2"
        )
    return inverse_B, counts_G


def _kept_per_group(kept_B: Tensor, inverse_B: Tensor) -> Tensor:
    num_groups = int(inverse_B.max()) + 1
    return torch.zeros(num_groups, dtype=torch.long, device=inverse_B.device).index_add_(
        0, inverse_B, kept_B.long()
    )


def _centred(scores_B: Tensor, group_ids_B: Tensor, kept_B: Tensor) -> Tensor:
    """``s - mean_g`` over the ``kept_B`` samples (0 for the others) in float64: a float32
    mean of near-equal scores is off by whole ulps, which near-zero-std groups then amplify.
    Non-finite scores of kept samples are rejected (they would poison every baseline of
    their group)."""
    bad_B = kept_B & ~torch.isfinite(scores_B)
    if bool(bad_B.any()):
        bad = torch.nonzero(bad_B).flatten().tolist()
        raise ValueError(f"non-finite reward for samples {bad}; fix the reward function")
    scores_B = torch.where(kept_B, scores_B.to(torch.float64), 0.0)
    inverse_B, _ = _group_index(group_ids_B)
    kept_G = _kept_per_group(kept_B, inverse_B).to(scores_B.dtype)
    sums_G = torch.zeros_like(kept_G).index_add_(0, inverse_B, scores_B)
    means_B = (sums_G / kept_G.clamp(min=1))[inverse_B]
    return torch.where(kept_B, scores_B - means_B, 0.0)
