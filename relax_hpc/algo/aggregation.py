"""Masked reductions: selecting valid tokens, whitening, and loss aggregation modes.

Every reduction *selects* valid tokens with ``torch.where`` before it sums, so garbage or NaN
in padded or observation positions never leaks into a result (``NaN * 0`` is NaN).

Data-parallel invariance: a rank that passes the *global* token / sequence count (over all
ranks and micro-batches of the optimizer step) and ``dp_size`` gets a loss whose sum over
micro-batches, averaged over ranks (what DDP/FSDP gradient averaging does), equals the loss
of the whole step batch on one rank. Sum micro-batch losses; do not average them.

Must not: call torch.distributed (counts are passed in), or import anything outside algo.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Floor on the variance used for whitening: population variance, so one valid token is
# fine (its whitened value is 0) where the unbiased variance would divide by zero.
WHITEN_VARIANCE_FLOOR = 1e-8


def select(x_BT: Tensor, response_mask_BT: Tensor) -> Tensor:
    """``x`` on valid tokens, exactly 0 elsewhere (also in the gradient)."""
    return torch.where(response_mask_BT.bool(), x_BT, torch.zeros_like(x_BT))


def masked_sum(x_BT: Tensor, response_mask_BT: Tensor, dim: int | None = None) -> Tensor:
    selected = select(x_BT, response_mask_BT)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(x_BT: Tensor, response_mask_BT: Tensor) -> Tensor:
    """Mean over valid tokens; 0 when there are none."""
    num_tokens = response_mask_BT.bool().sum().clamp(min=1)
    return masked_sum(x_BT, response_mask_BT) / num_tokens


def masked_whiten(x_BT: Tensor, response_mask_BT: Tensor) -> Tensor:
    """``(x - mean) / sqrt(max(var, 1e-8))`` over valid tokens (population variance); 0 elsewhere."""
    mean = masked_mean(x_BT, response_mask_BT)
    variance = masked_mean((x_BT - mean) ** 2, response_mask_BT)
    whitened = (x_BT - mean) * torch.rsqrt(variance.clamp(min=WHITEN_VARIANCE_FLOOR))
    return select(whitened, response_mask_BT)


def aggregate(
    loss_BT: Tensor,
    response_mask_BT: Tensor,
    loss_agg_mode: str,
    loss_scale_factor: float | None = None,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> Tensor:
    """Reduce a per-token loss to a scalar.

    Modes: ``token-mean`` (sum / tokens), ``seq-mean-token-sum`` (per-row sums averaged over
    non-empty rows), ``seq-mean-token-mean`` (per-row means averaged over non-empty rows),
    ``seq-mean-token-sum-norm`` (sum / ``loss_scale_factor``, a constant). Empty rows never
    count as sequences. Without global counts the local count is used and ``dp_size`` must
    be 1 (the loss would silently depend on the number of ranks otherwise).
    """
    mask_BT = response_mask_BT.bool()
    row_sums_B = masked_sum(loss_BT, mask_BT, dim=-1)
    row_lengths_B = mask_BT.sum(-1)
    if loss_agg_mode == "token-mean":
        return _normalise(row_sums_B.sum(), row_lengths_B.sum(), global_num_tokens, dp_size)
    if loss_agg_mode == "seq-mean-token-sum":
        return _normalise(row_sums_B.sum(), (row_lengths_B > 0).sum(), global_num_seqs, dp_size)
    if loss_agg_mode == "seq-mean-token-mean":
        row_means_B = row_sums_B / row_lengths_B.clamp(min=1)
        return _normalise(row_means_B.sum(), (row_lengths_B > 0).sum(), global_num_seqs, dp_size)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None or loss_scale_factor <= 0:
            raise ValueError(
                "seq-mean-token-sum-norm needs a constant loss_scale_factor > 0 "
                "(e.g. the max response length in tokens)"
            )
        # Sums add up over ranks, so scaling by dp_size undoes the DP average.
        return row_sums_B.sum() / loss_scale_factor * dp_size
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")


def _normalise(
    local_total: Tensor, local_count: Tensor, global_count: int | Tensor | None, dp_size: int
) -> Tensor:
    if global_count is None:
        if dp_size != 1:
            raise ValueError(
                f"dp_size={dp_size} needs the global token or sequence count; pass "
                "global_num_tokens / global_num_seqs so the loss is rank-count invariant"
            )
        return local_total / local_count.clamp(min=1)
    count = torch.as_tensor(global_count, dtype=local_total.dtype, device=local_total.device)
    return local_total / count.clamp(min=1) * dp_size
