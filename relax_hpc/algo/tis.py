"""Truncated importance sampling for the rollout/trainer mismatch.

The rollout engine (SGLang, different kernels and precision) and the trainer assign slightly
different log-probs to the same tokens under the same weights. The weight
``w = exp(old_logprobs - rollout_logprobs)`` (detached) corrects the policy loss for it:
``truncate`` clips w to [low, cap] (TIS), ``mask`` zeroes tokens whose w falls outside
[low, cap] (IcePop; they stay in the aggregation's denominator). Sequence level uses one
weight per sample, exp of the summed log-ratio over valid tokens.

Must not: aggregate the loss, or import anything outside algo.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_hpc.algo.aggregation import masked_mean, masked_sum, select
from relax_hpc.algo.kl import LOG_RATIO_CLAMP


def truncated_is_weights(
    old_logprobs_BT: Tensor,
    rollout_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    mode: str,
    level: str = "token",
    cap: float = 2.0,
    low: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token IS weights (0 outside the mask, detached) and their metrics."""
    if mode not in ("truncate", "mask"):
        raise ValueError(f"unknown TIS mode {mode!r}; use truncate or mask")
    with torch.no_grad():
        log_w_BT = select(old_logprobs_BT - rollout_logprobs_BT, response_mask_BT)
        if level == "sequence":
            log_w_BT = masked_sum(log_w_BT, response_mask_BT, dim=-1)[:, None].expand_as(log_w_BT)
        elif level != "token":
            raise ValueError(f"unknown TIS level {level!r}; use token or sequence")
        raw_w_BT = torch.exp(log_w_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        outside_BT = (raw_w_BT < low) | (raw_w_BT > cap)
        if mode == "truncate":
            w_BT = raw_w_BT.clamp(low, cap)
        else:
            w_BT = torch.where(outside_BT, torch.zeros_like(raw_w_BT), raw_w_BT)
        metrics = {
            "tis_weight_mean": masked_mean(raw_w_BT, response_mask_BT),
            "tis_clipfrac": masked_mean(outside_BT.to(raw_w_BT.dtype), response_mask_BT),
        }
        return select(w_BT, response_mask_BT), metrics
