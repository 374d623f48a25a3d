"""Per-token policy and value losses, and token entropy.

Each policy loss takes the current log-probs (differentiable), the old log-probs the ratio is
taken against, detached advantages and the response mask, and returns a ``[B, T]`` loss
matrix (to be minimised; 0 outside the mask) plus metrics (0-dim, detached, local masked
means). Aggregation is separate (``aggregation.aggregate``).

Log-ratios are clamped to [-20, 20] before ``exp`` so one outlier cannot overflow.

Must not: aggregate, call torch.distributed, or import anything outside algo.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relax_hpc.algo.aggregation import masked_mean, select
from relax_hpc.algo.kl import LOG_RATIO_CLAMP

Metrics = dict[str, Tensor]
LossAndMetrics = tuple[Tensor, Metrics]

# GSPO clamps the sequence log-ratio from above only: a huge ratio would overflow.
GSPO_LOG_RATIO_MAX = 10.0
# SAPO reports tokens whose gradient weight 4p(1-p) fell below this as "soft-clipped".
SAPO_SOFT_CLIP_WEIGHT = 0.9
# M2PO tolerances of the reference code, and its "no constraint" ratio bounds.
M2PO_TOL = 1e-12
M2PO_UNCONSTRAINED_MAX_RATIO = 1e5


def ppo_clip_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    clip_low: float | Tensor = 0.2,
    clip_high: float | Tensor = 0.2,
    dual_clip_c: float | None = 3.0,
) -> LossAndMetrics:
    """PPO clipped surrogate with asymmetric bounds (DAPO) and optional dual-clip.

    ``max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` dual-clip caps
    it at ``-c A`` so a token with a huge ratio cannot dominate.
    """
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, response_mask_BT)
    advantages_BT = select(advantages_BT, response_mask_BT).detach()
    loss_BT, clipped_BT = _clipped_surrogate(
        torch.exp(log_ratio_BT), advantages_BT, clip_low, clip_high
    )
    metrics = {
        "pg_clipfrac": _fraction(clipped_BT, response_mask_BT),
        "ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT).detach(),
    }
    if dual_clip_c is not None:
        if dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
        cap_BT = -advantages_BT * dual_clip_c
        negative_BT = advantages_BT < 0
        metrics["pg_clipfrac_lower"] = _fraction(negative_BT & (loss_BT > cap_BT), response_mask_BT)
        loss_BT = torch.where(negative_BT, torch.minimum(loss_BT, cap_BT), loss_BT)
    return select(loss_BT, response_mask_BT), metrics


def gspo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> LossAndMetrics:
    """GSPO ("GSPO-token" form): every token uses the sequence ratio in the PPO clip.

    The sequence ratio is the geometric mean of the token ratios over valid tokens; each token
    carries it as ``sg(s_i) * exp(l_t - sg(l_t))``: value ``s_i``, gradient through its own
    log-prob only. No dual-clip.
    """
    mask_BT = response_mask_BT.bool()
    token_log_ratio_BT = select(logprobs_BT - old_logprobs_BT, mask_BT)
    seq_log_ratio_B = token_log_ratio_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)
    logprobs_BT = select(logprobs_BT, mask_BT)
    log_ratio_BT = seq_log_ratio_B.detach()[:, None] + logprobs_BT - logprobs_BT.detach()
    ratio_BT = torch.exp(log_ratio_BT.clamp(max=GSPO_LOG_RATIO_MAX))
    advantages_BT = select(advantages_BT, mask_BT).detach()
    loss_BT, clipped_BT = _clipped_surrogate(ratio_BT, advantages_BT, clip_low, clip_high)
    metrics = {
        "pg_clipfrac": _fraction(clipped_BT, mask_BT),
        "ppo_kl": masked_mean(-token_log_ratio_BT, mask_BT).detach(),
    }
    return select(loss_BT, mask_BT), metrics


def sapo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> LossAndMetrics:
    """SAPO: ``-A (4 / tau) sigmoid(tau (rho - 1))``, a smooth gate instead of a hard clip.

    The gate has slope 1 at rho = 1 (vanilla policy gradient on-policy) and its gradient
    weight ``4 p (1 - p)`` decays smoothly off-policy; tau_neg > tau_pos decays faster for
    negative advantages.
    """
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, response_mask_BT)
    advantages_BT = select(advantages_BT, response_mask_BT).detach()
    tau_BT = torch.where(
        advantages_BT > 0,
        torch.full_like(advantages_BT, tau_pos),
        torch.full_like(advantages_BT, tau_neg),
    )
    gate_probability_BT = torch.sigmoid(tau_BT * (torch.exp(log_ratio_BT) - 1))
    loss_BT = -advantages_BT * (4 / tau_BT) * gate_probability_BT
    gradient_weight_BT = 4 * gate_probability_BT * (1 - gate_probability_BT)
    metrics = {
        "pg_clipfrac": _fraction(gradient_weight_BT < SAPO_SOFT_CLIP_WEIGHT, response_mask_BT),
        "ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT).detach(),
    }
    return select(loss_BT, response_mask_BT), metrics


def cispo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    clip_low: float = 1.0,
    clip_high: float = 4.0,
) -> LossAndMetrics:
    """CISPO: ``-sg(clip(rho, 1 - clip_low, 1 + clip_high)) A l``.

    The IS weight is clipped, not the update, so every token keeps a gradient; two-sided and
    independent of the sign of A (paper, verl, slime).
    """
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, response_mask_BT)
    advantages_BT = select(advantages_BT, response_mask_BT).detach()
    ratio_BT = torch.exp(log_ratio_BT).detach()
    lower, upper = 1 - clip_low, 1 + clip_high
    weight_BT = ratio_BT.clamp(lower, upper)
    loss_BT = -weight_BT * advantages_BT * select(logprobs_BT, response_mask_BT)
    metrics = {
        "pg_clipfrac": _fraction((ratio_BT < lower) | (ratio_BT > upper), response_mask_BT),
        "ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT).detach(),
    }
    return select(loss_BT, response_mask_BT), metrics


def reinforce_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
) -> LossAndMetrics:
    """Unclipped REINFORCE / RLOO: ``-A l``. No ratio, so only correct on-policy."""
    advantages_BT = select(advantages_BT, response_mask_BT).detach()
    loss_BT = -advantages_BT * select(logprobs_BT, response_mask_BT)
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, response_mask_BT)
    metrics = {"ppo_kl": masked_mean(-log_ratio_BT, response_mask_BT).detach()}
    return select(loss_BT, response_mask_BT), metrics


def m2po_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    budget: float = 0.01,
    min_clip_low: float = 0.3,
    min_clip_high: float = 0.5,
) -> LossAndMetrics:
    """M2PO (clip-band form): PPO clip whose margins come from a second-moment budget.

    See ``m2po_clip_margins``. The margins are solved on the tokens passed in (per
    micro-batch, like the reference code). No dual-clip.
    """
    log_ratio_BT = _log_ratio(logprobs_BT, old_logprobs_BT, response_mask_BT)
    advantages_BT = select(advantages_BT, response_mask_BT).detach()
    clip_low, clip_high, metrics = m2po_clip_margins(
        log_ratio_BT, advantages_BT, response_mask_BT, budget, min_clip_low, min_clip_high
    )
    loss_BT, clipped_BT = _clipped_surrogate(
        torch.exp(log_ratio_BT), advantages_BT, clip_low, clip_high
    )
    metrics["pg_clipfrac"] = _fraction(clipped_BT, response_mask_BT)
    metrics["ppo_kl"] = masked_mean(-log_ratio_BT, response_mask_BT).detach()
    return select(loss_BT, response_mask_BT), metrics


def m2po_clip_margins(
    log_ratio_BT: Tensor,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    budget: float,
    min_clip_low: float,
    min_clip_high: float,
) -> tuple[float, float, Metrics]:
    """Clip margins that keep the second moment of harmful tokens' log-ratios within budget.

    Harmful (valid) tokens push further off-policy: ``A > 0, rho > 1`` or ``A < 0, rho < 1``.
    If their mean squared log-ratio ``M2`` exceeds ``budget``, water-filling finds the cap
    ``tau^2`` on squared log-ratios that brings it under the budget, and the ratio band is
    ``[e^-tau, e^tau]``; margins are never tighter than the configured floors.
    """
    with torch.no_grad():
        log_ratio = log_ratio_BT.detach().double()
        ratio = torch.exp(log_ratio)
        harmful = response_mask_BT.bool() & (
            ((advantages_BT > M2PO_TOL) & (ratio > 1 + M2PO_TOL))
            | ((advantages_BT < -M2PO_TOL) & (ratio < 1 - M2PO_TOL))
        )
        squared = (log_ratio**2)[harmful]
        m2_before = squared.mean().item() if squared.numel() else 0.0
        if m2_before <= budget + M2PO_TOL:
            tau, m2_after = None, m2_before
        else:
            tau, m2_after = _water_fill(squared, budget)
    if tau is None:
        clip_low, clip_high = 1.0, M2PO_UNCONSTRAINED_MAX_RATIO - 1
    else:
        clip_low, clip_high = 1 - math.exp(-tau), math.exp(tau) - 1
    clip_low, clip_high = max(clip_low, min_clip_low), max(clip_high, min_clip_high)
    metrics = {
        "m2po_m2_before": torch.tensor(m2_before),
        "m2po_m2_after": torch.tensor(m2_after),
        "m2po_clip_low": torch.tensor(clip_low),
        "m2po_clip_high": torch.tensor(clip_high),
    }
    return clip_low, clip_high, metrics


def _water_fill(squared: Tensor, budget: float) -> tuple[float, float]:
    """Largest cap on the sorted values that keeps their capped mean within the budget."""
    n = squared.numel()
    sorted_values = torch.sort(squared).values
    prefix_sums = torch.cumsum(sorted_values, 0)
    num_above = n - 1 - torch.arange(n, dtype=sorted_values.dtype)
    capped_totals = (sorted_values - M2PO_TOL) * num_above + prefix_sums
    k = int(torch.nonzero(capped_totals >= n * budget - M2PO_TOL)[0])
    if k == 0:
        return 0.0, sorted_values.mean().item()
    cap = sorted_values[k - 1].item()
    m2_after = (cap * (n - k) + prefix_sums[k - 1].item()) / n
    return math.sqrt(max(cap - M2PO_TOL, 0.0)), m2_after


def clipped_value_loss(
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    response_mask_BT: Tensor,
    value_clip: float = 0.5,
) -> LossAndMetrics:
    """Critic loss ``0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`` per token."""
    values_BT = select(values_BT, response_mask_BT)
    old_values_BT = select(old_values_BT, response_mask_BT).detach()
    returns_BT = select(returns_BT, response_mask_BT).detach()
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-value_clip, value_clip)
    unclipped_loss_BT = (values_BT - returns_BT) ** 2
    clipped_loss_BT = (clipped_values_BT - returns_BT) ** 2
    loss_BT = 0.5 * torch.maximum(unclipped_loss_BT, clipped_loss_BT)
    metrics = {"vf_clipfrac": _fraction(clipped_loss_BT > unclipped_loss_BT, response_mask_BT)}
    return select(loss_BT, response_mask_BT), metrics


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Token entropy ``logsumexp(z) - sum softmax(z) z`` over the vocabulary (last dim)."""
    return torch.logsumexp(logits_BTV, dim=-1) - (
        torch.softmax(logits_BTV, dim=-1) * logits_BTV
    ).sum(-1)


def _log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor, response_mask_BT: Tensor) -> Tensor:
    log_ratio_BT = select(logprobs_BT - old_logprobs_BT, response_mask_BT)
    return log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _clipped_surrogate(
    ratio_BT: Tensor,
    advantages_BT: Tensor,
    clip_low: float | Tensor,
    clip_high: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """``max(-A rho, -A clip(rho))`` and where the clipped term won."""
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped_BT, clipped_BT), clipped_BT > unclipped_BT


def _fraction(flags_BT: Tensor, response_mask_BT: Tensor) -> Tensor:
    return masked_mean(flags_BT.to(torch.float32), response_mask_BT).detach()
