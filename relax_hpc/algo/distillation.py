"""On-policy distillation (OPD): a teacher's log-probs on the student's sampled tokens.

Two forms. Advantage mode (the default, principled one): the detached per-token
``l_S - l_T`` is subtracted from the advantage, which makes the policy gradient the gradient
of the reverse KL(student || teacher) (Thinking Machines / tinker-cookbook). Loss mode adds
``coef * agg(divergence)`` to the loss; its gradient lowers every sampled token's log-prob
by the same amount, so it is *not* the reverse-KL gradient (kept for parity with Relax).

Student log-probs are the trainer's (re-computed) ones.

Must not: aggregate or import anything outside algo.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_hpc.algo.aggregation import select
from relax_hpc.algo.kl import LOG_RATIO_CLAMP


def opd_divergence(
    student_logprobs_BT: Tensor,
    teacher_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    kl_type: str,
    per_token_clip: float | None = None,
) -> Tensor:
    """Per-token reverse-KL estimate of the student from the teacher on sampled tokens.

    ``reverse_kl``: ``l_S - l_T``; ``low_var_kl``: ``e^(l_T - l_S) - 1 + (l_S - l_T)``. An
    optional upper clamp bounds a token's divergence. Differentiable through the student.
    """
    log_ratio_BT = select(student_logprobs_BT - teacher_logprobs_BT.detach(), response_mask_BT)
    if kl_type == "reverse_kl":
        divergence_BT = log_ratio_BT
    elif kl_type == "low_var_kl":
        # Clamped like k3 so an outlier token cannot overflow float32.
        neg_log_ratio = (-log_ratio_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        divergence_BT = torch.exp(neg_log_ratio) - 1 - neg_log_ratio
    else:
        raise ValueError(f"unknown OPD kl_type {kl_type!r}; use reverse_kl or low_var_kl")
    if per_token_clip is not None:
        divergence_BT = divergence_BT.clamp(max=per_token_clip)
    return select(divergence_BT, response_mask_BT)


def opd_shaped_advantages(
    advantages_BT: Tensor,
    student_logprobs_BT: Tensor,
    teacher_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    coef: float,
    kl_type: str = "reverse_kl",
    per_token_clip: float | None = None,
    only_reward: bool = False,
) -> Tensor:
    """On-policy distillation as shaping: ``A' = A - coef * sg(divergence)``.

    The detached per-token ``l_S - l_T`` used as an advantage is the policy-gradient signal of
    the reverse KL(student || teacher). ``only_reward`` drops the task advantage.
    """
    with torch.no_grad():
        divergence_BT = opd_divergence(
            student_logprobs_BT, teacher_logprobs_BT, response_mask_BT, kl_type, per_token_clip
        )
        task_BT = torch.zeros_like(divergence_BT) if only_reward else advantages_BT
        return select(task_BT - coef * divergence_BT, response_mask_BT)


def opd_loss_per_token(
    logprobs_BT: Tensor,
    teacher_logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    response_mask_BT: Tensor,
    kl_type: str = "reverse_kl",
    per_token_clip: float | None = None,
    is_clip: float | None = None,
) -> Tensor:
    """Loss-mode distillation term per token, optionally times ``sg(min(ratio, is_clip))``."""
    divergence_BT = opd_divergence(
        logprobs_BT, teacher_logprobs_BT, response_mask_BT, kl_type, per_token_clip
    )
    if is_clip is not None:
        log_ratio_BT = select(logprobs_BT - old_logprobs_BT, response_mask_BT).detach()
        ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        divergence_BT = divergence_BT * ratio_BT.clamp(max=is_clip)
    return select(divergence_BT, response_mask_BT)
