"""Per-token KL estimators between a policy and a reference, and KL-in-reward shaping.

With ``x = logprobs - ref_logprobs`` on the sampled token (J. Schulman, "Approximating KL
divergence"): k1 = x, abs = |x|, k2 = x^2 / 2, k3 = e^-x - 1 + x. The "+" variants are
straight-through: the value of the base estimator with the gradient of k2, which is the
correct gradient of KL(pi || pi_ref).

Must not: aggregate (callers choose the aggregation) or import anything outside algo.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_hpc.algo.aggregation import select

# Log-ratios are clamped before exp so one outlier token cannot overflow float32.
LOG_RATIO_CLAMP = 20.0
# k3 values are clamped too: a k3 of 1e6 on one token would dominate the batch.
K3_VALUE_CLAMP = 10.0

_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}


def kl_penalty(
    logprobs_BT: Tensor, ref_logprobs_BT: Tensor, response_mask_BT: Tensor, kl_type: str
) -> Tensor:
    """Per-token KL estimate, 0 outside the mask; differentiable through ``logprobs_BT``."""
    base, straight_through = _parse_kl_type(kl_type)
    log_ratio_BT = select(logprobs_BT - ref_logprobs_BT, response_mask_BT)
    value_BT = _estimate(log_ratio_BT, base)
    if straight_through:
        k2_BT = 0.5 * log_ratio_BT**2
        value_BT = k2_BT - k2_BT.detach() + value_BT.detach()
    return select(value_BT, response_mask_BT)


def reward_kl_penalty(
    old_logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    kl_coef: float,
    kl_type: str,
) -> Tensor:
    """The KL-in-reward term ``coef * k(old, ref)`` per token, detached (experience time)."""
    with torch.no_grad():
        return kl_coef * kl_penalty(old_logprobs_BT, ref_logprobs_BT, response_mask_BT, kl_type)


def _parse_kl_type(kl_type: str) -> tuple[str, bool]:
    straight_through = kl_type.endswith("+")
    base = _ALIASES.get(kl_type.rstrip("+"), kl_type.rstrip("+"))
    if base not in ("k1", "abs", "k2", "k3") or (straight_through and base not in ("k1", "k3")):
        raise ValueError(
            f"unknown kl_type {kl_type!r}; use k1|kl, abs, k2|mse, k3|low_var_kl, k1+, k3+"
        )
    return base, straight_through


def _estimate(log_ratio_BT: Tensor, base: str) -> Tensor:
    if base == "k1":
        return log_ratio_BT
    if base == "abs":
        return log_ratio_BT.abs()
    if base == "k2":
        return 0.5 * log_ratio_BT**2
    neg_log_ratio = (-log_ratio_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.exp(neg_log_ratio) - 1 - neg_log_ratio
    return k3.clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
