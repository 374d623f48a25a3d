"""The three calls the trainer makes: advantages, actor loss, value loss.

Each takes an ``AlgorithmSpec`` (``registry.resolve(cfg)``, once per run) or an
``AlgoConfig`` (resolved on the fly) and dispatches through it, so the trainer never branches
on algorithm names. Loss calls return ``(scalar_loss, metrics)`` with detached 0-dim metrics.

Data parallelism: pass ``global_num_tokens`` and ``global_num_seqs`` (valid tokens and
non-empty samples of the whole optimizer step, over all ranks and micro-batches) and
``dp_size``; sum the micro-batch losses. The result is then independent of the number of ranks.

Must not: call torch.distributed, do I/O, or import anything outside algo.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from relax_hpc.algo import advantages as adv
from relax_hpc.algo.aggregation import aggregate, masked_whiten
from relax_hpc.algo.distillation import opd_loss_per_token, opd_shaped_advantages
from relax_hpc.algo.kl import kl_penalty, reward_kl_penalty
from relax_hpc.algo.losses import Metrics, clipped_value_loss
from relax_hpc.algo.registry import AdvantageInputs, AlgorithmSpec, resolve
from relax_hpc.algo.tis import truncated_is_weights
from relax_hpc.config.algo import AlgoConfig


def as_spec(algo: AlgorithmSpec | AlgoConfig) -> AlgorithmSpec:
    return algo if isinstance(algo, AlgorithmSpec) else resolve(algo)


def trained_samples(
    algo: AlgorithmSpec | AlgoConfig, scored_B: Tensor | None, group_ids_B: Tensor | None
) -> Tensor | None:
    """bool ``[B]``: the samples that carry a gradient when ``scored_B`` is False for those
    whose reward failed; None when every sample does. A group estimator also drops the
    groups left with fewer than two scored samples (``advantages.trained_samples``)."""
    if scored_B is None:
        return None
    spec = as_spec(algo)
    if spec.group_based and group_ids_B is not None:
        return adv.trained_samples(scored_B, group_ids_B)
    return scored_B.bool()


def dropped_groups(
    algo: AlgorithmSpec | AlgoConfig, scored_B: Tensor | None, group_ids_B: Tensor | None
) -> int:
    """Groups that ``trained_samples`` drops for want of two scored samples."""
    if scored_B is None or group_ids_B is None or not as_spec(algo).group_based:
        return 0
    return adv.num_dropped_groups(scored_B, group_ids_B)


def compute_advantages(
    algo: AlgorithmSpec | AlgoConfig,
    rewards_B: Tensor,
    response_mask_BT: Tensor,
    group_ids_B: Tensor | None = None,
    values_BT: Tensor | None = None,
    old_logprobs_BT: Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
    teacher_logprobs_BT: Tensor | None = None,
    scored_B: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns, ``[B, T]``, 0 outside the mask; call on the whole step batch.

    Order: KL-in-reward shaping -> estimator -> distillation shaping -> optional whitening.
    ``old_logprobs_BT`` are the trainer's log-probs of the rollout policy (KL in reward and
    the student side of distillation). ``scored_B`` False: the sample's reward failed; it
    and the samples ``trained_samples`` drops get 0 and enter no statistic (group means and
    stds, batch whitening).
    """
    spec = as_spec(algo)
    cfg = spec.config
    mask_BT = response_mask_BT.bool()
    trained_B = trained_samples(spec, scored_B, group_ids_B)
    if trained_B is not None:
        mask_BT = mask_BT & trained_B.to(mask_BT.device)[:, None]
    rewards_B = rewards_B.to(torch.float32) if not rewards_B.is_floating_point() else rewards_B
    reward_kl_BT = None
    if cfg.kl_in_reward_coef > 0:
        reward_kl_BT = reward_kl_penalty(
            _needed(old_logprobs_BT, "old_logprobs_BT", "algo.kl_in_reward_coef > 0"),
            _needed(ref_logprobs_BT, "ref_logprobs_BT", "algo.kl_in_reward_coef > 0"),
            mask_BT,
            cfg.kl_in_reward_coef,
            cfg.kl_in_reward_type,
        )
    distill_only = spec.needs_teacher and cfg.opd_only_reward
    if distill_only:
        advantages_BT = torch.zeros(mask_BT.shape, dtype=rewards_B.dtype, device=mask_BT.device)
        returns_BT = advantages_BT
    else:
        inputs = AdvantageInputs(rewards_B, mask_BT, group_ids_B, values_BT, reward_kl_BT, scored_B)
        advantages_BT, returns_BT = spec.estimate_advantages(inputs)
    if spec.needs_teacher and cfg.opd_mode == "advantage":
        advantages_BT = opd_shaped_advantages(
            advantages_BT,
            _needed(old_logprobs_BT, "old_logprobs_BT", "distillation"),
            _needed(teacher_logprobs_BT, "teacher_logprobs_BT", "algo.opd_coef > 0"),
            mask_BT,
            cfg.opd_coef,
            cfg.opd_kl_type,
            cfg.opd_per_token_clip,
            cfg.opd_only_reward,
        )
    if spec.normalize_advantages:
        advantages_BT = masked_whiten(advantages_BT, mask_BT)
    return advantages_BT, returns_BT


def actor_loss(
    algo: AlgorithmSpec | AlgoConfig,
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor | None,
    advantages_BT: Tensor,
    response_mask_BT: Tensor,
    rollout_logprobs_BT: Tensor | None = None,
    ref_logprobs_BT: Tensor | None = None,
    entropy_BT: Tensor | None = None,
    teacher_logprobs_BT: Tensor | None = None,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, Metrics]:
    """``agg(w * L_pg) - c_ent agg(H) + c_kl agg(k(l, l_ref)) [+ c_opd token-mean(opd)]``.

    ``w`` is the truncated IS weight when ``algo.tis_mode`` is set. With
    ``algo.use_rollout_logprobs`` the rollout log-probs are the old policy and
    ``old_logprobs_BT`` may be None.
    """
    spec = as_spec(algo)
    cfg = spec.config
    mask_BT = response_mask_BT.bool()
    agg = functools.partial(
        aggregate,
        response_mask_BT=mask_BT,
        loss_agg_mode=spec.loss_agg_mode,
        loss_scale_factor=cfg.loss_scale_factor,
        global_num_tokens=global_num_tokens,
        global_num_seqs=global_num_seqs,
        dp_size=dp_size,
    )
    if cfg.use_rollout_logprobs:
        old_logprobs_BT = _needed(
            rollout_logprobs_BT, "rollout_logprobs_BT", "use_rollout_logprobs"
        )
    old_logprobs_BT = _needed(old_logprobs_BT, "old_logprobs_BT", "the policy loss")
    loss_BT, metrics = spec.policy_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    if cfg.tis_mode != "none":
        weights_BT, tis_metrics = truncated_is_weights(
            old_logprobs_BT,
            _needed(rollout_logprobs_BT, "rollout_logprobs_BT", "algo.tis_mode"),
            mask_BT,
            cfg.tis_mode,
            cfg.tis_level,
            cfg.tis_cap,
            cfg.tis_low,
        )
        loss_BT = loss_BT * weights_BT
        metrics.update(tis_metrics)
    total = agg(loss_BT)
    metrics["pg_loss"] = total.detach()
    if entropy_BT is not None or cfg.entropy_coef > 0:
        entropy = agg(_needed(entropy_BT, "entropy_BT", "algo.entropy_coef > 0"))
        metrics["entropy"] = entropy.detach()
        if cfg.entropy_coef > 0:
            total = total - cfg.entropy_coef * entropy
    if cfg.kl_loss_coef > 0:
        ref_BT = _needed(ref_logprobs_BT, "ref_logprobs_BT", "algo.kl_loss_coef > 0")
        kl = agg(kl_penalty(logprobs_BT, ref_BT, mask_BT, cfg.kl_loss_type))
        metrics["kl_loss"] = kl.detach()
        total = total + cfg.kl_loss_coef * kl
    if spec.needs_teacher and cfg.opd_mode == "loss":
        opd_BT = opd_loss_per_token(
            logprobs_BT,
            _needed(teacher_logprobs_BT, "teacher_logprobs_BT", "algo.opd_coef > 0"),
            old_logprobs_BT,
            mask_BT,
            cfg.opd_kl_type,
            cfg.opd_per_token_clip,
            cfg.opd_is_clip,
        )
        opd = aggregate(opd_BT, mask_BT, "token-mean", None, global_num_tokens, None, dp_size)
        metrics["opd_loss"] = opd.detach()
        total = total + cfg.opd_coef * opd
    metrics["actor_loss"] = total.detach()
    return total, metrics


def value_loss(
    algo: AlgorithmSpec | AlgoConfig,
    values_BT: Tensor,
    old_values_BT: Tensor,
    returns_BT: Tensor,
    response_mask_BT: Tensor,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    dp_size: int = 1,
) -> tuple[Tensor, Metrics]:
    """``value_loss_coef * agg(0.5 max((V - R)^2, (V_clipped - R)^2))`` for the critic."""
    spec = as_spec(algo)
    cfg = spec.config
    loss_BT, metrics = clipped_value_loss(
        values_BT, old_values_BT, returns_BT, response_mask_BT, cfg.value_clip
    )
    loss = cfg.value_loss_coef * aggregate(
        loss_BT,
        response_mask_BT,
        spec.loss_agg_mode,
        cfg.loss_scale_factor,
        global_num_tokens,
        global_num_seqs,
        dp_size,
    )
    metrics["value_loss"] = loss.detach()
    return loss, metrics


def _needed(tensor: Tensor | None, name: str, reason: str) -> Tensor:
    if tensor is None:
        raise ValueError(f"{name} is required by {reason}")
    return tensor
