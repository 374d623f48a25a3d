"""One training step's arithmetic: old log-probs, advantages, then the optimiser updates.

Every rank holds the whole step batch (advantages need complete groups); mini-batch ``m``
is the ``m``-th slice of the batch and rank ``r`` trains on every ``world``-th row of it.
Losses are normalised by the *global* token / sequence counts of the mini-batch, so the
result does not depend on the number of ranks (``relax_hpc.algo`` aggregation).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from relax_hpc.algo import (
    AlgorithmSpec,
    actor_loss,
    compute_advantages,
    dropped_groups,
    trained_samples,
    value_loss,
)
from relax_hpc.trainer.backend import Model, Networks
from relax_hpc.trainer.batch import TrainBatch


@dataclass
class StepTensors:
    """Per-token tensors of the whole step batch, computed once before the updates."""

    old_logprobs_BT: Tensor | None  # None: the training forward's own, detached (see below)
    advantages_BT: Tensor
    returns_BT: Tensor
    ref_logprobs_BT: Tensor | None = None
    teacher_logprobs_BT: Tensor | None = None
    old_values_BT: Tensor | None = None

    def rows(self, index: Tensor, width: int) -> StepTensors:
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[index][:, :width]

        return StepTensors(**{k: pick(v) for k, v in self.__dict__.items()})


def scored_samples(batch: TrainBatch) -> Tensor | None:
    """bool ``[B]``: samples whose reward was computed; None when every one was."""
    failed_B = batch.reward_failed_B
    return None if failed_B is None or not bool(failed_B.any()) else ~failed_B


def mask_failed_rewards(spec: AlgorithmSpec, batch: TrainBatch) -> tuple[TrainBatch, dict]:
    """The batch with the samples whose reward failed, and the groups they leave without a
    baseline, masked out of the loss (zero loss weight: they are consumed all the same),
    and their counts for TensorBoard."""
    scored_B = scored_samples(batch)
    trained_B = trained_samples(spec, scored_B, batch.group_index_B)
    counts = {
        "rewards/failed_samples": 0.0 if scored_B is None else float((~scored_B).sum()),
        "rewards/dropped_groups": float(dropped_groups(spec, scored_B, batch.group_index_B)),
    }
    if trained_B is None:
        return batch, counts
    mask_BT = batch.response_mask_BT * trained_B[:, None].to(batch.response_mask_BT.dtype)
    return replace(batch, response_mask_BT=mask_BT), counts


def old_logprobs_are_current(
    spec: AlgorithmSpec, epochs: int, mini_batches: int, deterministic_forward: bool
) -> bool:
    """Whether the old policy's log-probs are, exactly, the log-probs the training forward
    computes, so that forward's own (detached) can stand in and the extra no-gradient
    forward is skipped.

    The rule: one optimiser update per step (1 epoch x 1 mini-batch: the update's forward
    runs on the weights the old log-probs would be computed with); nothing needs the old
    log-probs before that forward (no KL in the reward, no distillation in the advantage);
    the old policy is not the rollout's own log-probs (``use_rollout_logprobs``); and a
    forward without randomness (no dropout). Then the ratio is exactly 1 with the gradient
    of the log-probs, as the recomputed path gives up to rounding.
    """
    cfg = spec.config
    needed_before_update = cfg.kl_in_reward_coef > 0 or (
        spec.needs_teacher and cfg.opd_mode == "advantage"
    )
    return (
        epochs == 1
        and mini_batches == 1
        and not cfg.use_rollout_logprobs
        and not needed_before_update
        and deterministic_forward
    )


def prepare_step(
    spec: AlgorithmSpec,
    batch: TrainBatch,
    nets: Networks,
    temperature: float,
    reuse_training_forward: bool = False,
) -> StepTensors:
    """Old/ref/teacher log-probs and values (no gradient), then advantages and returns.
    ``reuse_training_forward`` (``old_logprobs_are_current``): no old log-probs now, the
    update takes its forward's own."""
    cfg = spec.config
    if cfg.use_rollout_logprobs:
        old = batch.rollout_logprobs_BT
    elif reuse_training_forward:
        old = None
    else:
        old = nets.policy.logprobs(batch, temperature)
    ref = nets.reference.logprobs(batch, temperature) if nets.reference else None
    teacher = nets.teacher.logprobs(batch, temperature) if nets.teacher else None
    values = nets.critic.values(batch) if nets.critic else None
    advantages, returns = compute_advantages(
        spec,
        batch.rewards_B,
        batch.response_mask_BT,
        batch.group_index_B,
        values_BT=values,
        old_logprobs_BT=old,
        ref_logprobs_BT=ref,
        teacher_logprobs_BT=teacher,
        scored_B=scored_samples(batch),
    )
    return StepTensors(old, advantages, returns, ref, teacher, values)


def mini_batch_rows(num_samples: int, num_mini_batches: int, rank: int, world: int) -> list[Tensor]:
    """Row indices this rank trains on, per mini-batch (see the module docstring)."""
    chunks = torch.arange(num_samples).chunk(num_mini_batches)
    return [chunk[rank::world] for chunk in chunks]


def global_counts(batch: TrainBatch, num_mini_batches: int) -> list[tuple[int, int]]:
    """(valid tokens, non-empty sequences) of each global mini-batch."""
    counts = []
    for chunk in torch.arange(batch.num_samples).chunk(num_mini_batches):
        mask = batch.response_mask_BT[chunk]
        counts.append((int(mask.sum()), int((mask.sum(dim=1) > 0).sum())))
    return counts


# Terms the algo library already normalises by the global counts (summed over micro-batches);
# every other metric is a local mean, weighted by the micro-batch's share of tokens.
GLOBALLY_NORMALISED = frozenset(
    {"loss/actor", "loss/critic", "pg_loss", "entropy", "kl_loss", "opd_loss", "vf_loss"}
)


def _accumulate(
    totals: dict[str, float], metrics: dict[str, Tensor], share: float, epochs: int
) -> None:
    for name, value in metrics.items():
        weight = 1.0 if name in GLOBALLY_NORMALISED else share
        totals[name] = totals.get(name, 0.0) + float(value) * weight / epochs


def update_policy(
    spec: AlgorithmSpec,
    batch: TrainBatch,
    tensors: StepTensors,
    policy: Model,
    plan: tuple[int, int, int, int],
    temperature: float,
) -> dict[str, float]:
    """``plan`` = (epochs, mini-batches, rank, world). Returns averaged metrics."""
    epochs, num_mini, rank, world = plan
    counts = global_counts(batch, num_mini)
    totals: dict[str, float] = {}
    num_updates = 0
    for _ in range(epochs):
        for rows, (num_tokens, num_seqs) in zip(
            mini_batch_rows(batch.num_samples, num_mini, rank, world), counts, strict=True
        ):
            policy.zero_grad()
            local = batch.select(rows)
            micro_rows = _micro_rows(policy, local)
            micros = [local.select(r) for r in micro_rows]
            micro_loss = _actor_micro_loss(
                spec, tensors, [rows[r] for r in micro_rows], micros, (num_tokens, num_seqs), world
            )
            # The backend runs forward, loss and backward (a pipeline schedule under PP).
            results = policy.forward_backward(micros, temperature, micro_loss)
            for micro, metrics in zip(micros, results, strict=True):
                share = world * float(micro.response_mask_BT.sum()) / max(num_tokens, 1)
                loss = metrics.pop("loss")
                _accumulate(totals, {"loss/actor": loss, **metrics}, share, epochs)
            for name, value in policy.optimizer_step().items():
                totals[name] = totals.get(name, 0.0) + value
            num_updates += 1
    for key in ("grad_norm", "lr"):
        totals[key] = totals.get(key, 0.0) / max(num_updates, 1)
    return totals


def _actor_micro_loss(
    spec: AlgorithmSpec,
    tensors: StepTensors,
    rows_per_micro: list[Tensor],
    micros: list[TrainBatch],
    counts: tuple[int, int],
    world: int,
):
    """The ``loss_fn`` a backend's ``forward_backward`` calls for micro-batch ``index``."""
    need_entropy = spec.config.entropy_coef != 0
    num_tokens, num_seqs = counts

    def micro_loss(index: int, logprobs: Tensor, entropy: Tensor):
        micro = micros[index]
        part = tensors.rows(rows_per_micro[index], micro.response_mask_BT.shape[1])
        old = part.old_logprobs_BT
        return actor_loss(
            spec,
            logprobs,
            logprobs.detach() if old is None else old.to(logprobs.device),
            part.advantages_BT.to(logprobs.device),
            micro.response_mask_BT.to(logprobs.device),
            rollout_logprobs_BT=micro.rollout_logprobs_BT.to(logprobs.device),
            ref_logprobs_BT=_dev(part.ref_logprobs_BT, logprobs),
            entropy_BT=entropy if need_entropy else entropy.detach(),
            teacher_logprobs_BT=_dev(part.teacher_logprobs_BT, logprobs),
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            dp_size=world,
        )

    return micro_loss


def update_critic(
    spec: AlgorithmSpec,
    batch: TrainBatch,
    tensors: StepTensors,
    critic: Model,
    plan: tuple[int, int, int, int],
) -> dict[str, float]:
    epochs, num_mini, rank, world = plan
    counts = global_counts(batch, num_mini)
    totals: dict[str, float] = {}
    for _ in range(epochs):
        for rows, (num_tokens, num_seqs) in zip(
            mini_batch_rows(batch.num_samples, num_mini, rank, world), counts, strict=True
        ):
            critic.zero_grad()
            local = batch.select(rows)
            for micro_rows in _micro_rows(critic, local):
                micro = local.select(micro_rows)
                part = tensors.rows(rows[micro_rows], micro.response_mask_BT.shape[1])
                values = critic.token_values(micro)
                loss, metrics = value_loss(
                    spec,
                    values,
                    part.old_values_BT.to(values.device),
                    part.returns_BT.to(values.device),
                    micro.response_mask_BT.to(values.device),
                    global_num_tokens=num_tokens,
                    global_num_seqs=num_seqs,
                    dp_size=world,
                )
                (loss * spec.config.value_loss_coef).backward()
                share = world * float(micro.response_mask_BT.sum()) / max(num_tokens, 1)
                _accumulate(totals, {"loss/critic": loss.detach(), **metrics}, share, epochs)
            grads = critic.optimizer_step()
            totals["critic/grad_norm"] = grads["grad_norm"]
    return totals


def _micro_rows(model: Model, local: TrainBatch) -> list[Tensor]:
    return [torch.tensor(rows) for rows in model.micro_batch_rows(local)]


def _dev(tensor: Tensor | None, like: Tensor) -> Tensor | None:
    return None if tensor is None else tensor.to(like.device)
