"""The trainer loop, readable top to bottom:

    next_batch -> train_step -> publish_weights -> maybe_checkpoint -> log -> check_stop

``policy_version`` N is the policy after N optimiser steps (version 0 = initial weights),
so after step N the trainer publishes version N. Exit codes (``relax_hpc.exitcodes``): DONE
finished, STOPPED stopped with a checkpoint (signal or cancel request; the launcher
requeues or the user resumes).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax_hpc import exitcodes
from relax_hpc.algo import AlgorithmSpec
from relax_hpc.checkpoint.stateful import OpaqueState, RngState
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointInfo, CheckpointStore
from relax_hpc.observe.metrics import LogThrottle, MetricsLogger, PhaseTimer
from relax_hpc.spool import SpoolReader, SpoolTimeout
from relax_hpc.trainer.backend import TrainerBackend
from relax_hpc.trainer.batch import TrainBatch, collate
from relax_hpc.trainer.update import (
    mask_failed_rewards,
    old_logprobs_are_current,
    prepare_step,
    update_critic,
    update_policy,
)

log = logging.getLogger(__name__)

BATCH_WAIT_S = 2.0  # how long one spool wait lasts before the stop flag is looked at again


@dataclass
class Progress:
    """Resumable counters of the trainer (part of every checkpoint)."""

    step: int = 0
    samples: int = 0
    tokens: int = 0
    failed_samples: int = 0  # rewards that could not be computed: trained with no weight
    dropped_groups: int = 0  # groups left with fewer than two scored samples
    history: list[dict] = field(default_factory=list)  # per-step reward/accuracy summary
    sample_ids: list[list[str]] = field(default_factory=list)  # per step, when audited

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)

    @property
    def policy_version(self) -> int:
        return self.step


@dataclass
class LoopSettings:
    total_steps: int
    prompts_per_step: int
    checkpoint_interval_steps: int
    sync_interval_steps: int
    epochs_per_step: int
    mini_batches_per_step: int
    temperature: float
    pad_token_id: int
    rank: int = 0
    world_size: int = 1
    audit_sample_ids: bool = False


class Trainer:
    def __init__(
        self,
        settings: LoopSettings,
        spec: AlgorithmSpec,
        backend: TrainerBackend,  # its networks are built
        reader: SpoolReader | None,  # rank 0 only
        publish_weights,  # callable(policy_version) -> dict of metrics
        store: CheckpointStore,
        stop: StopFlag,
        metrics: MetricsLogger,
        broadcast_groups,  # callable(groups | None) -> groups, the same on every rank
        cost_metrics=lambda step: {},  # callable(step) -> device-hours so far (observe.cost)
        media_processor=None,  # the policy's MediaProcessor: rebuilds each group's media
        on_idle=lambda: None,  # called on every rank when a wait for samples timed out
    ) -> None:
        self.settings = settings
        self.spec = spec
        self.backend = backend
        self.nets = backend.nets
        self.reader = reader
        self.publish_weights = publish_weights
        self.store = store
        self.stop = stop
        self.metrics = metrics
        self.broadcast_groups = broadcast_groups
        self.cost_metrics = cost_metrics
        self.media_processor = media_processor
        self.on_idle = on_idle
        self.progress = Progress()
        self.timer = PhaseTimer()
        self.log_lines = LogThrottle()  # the per-step line: the first 10, then 1 a second
        self.checkpointed_step: int | None = None  # the step of the newest checkpoint
        # One optimiser update per step on a forward without randomness: the update's own
        # forward gives the old log-probs (update.old_logprobs_are_current), one forward less.
        self.reuse_training_forward = old_logprobs_are_current(
            spec,
            settings.epochs_per_step,
            settings.mini_batches_per_step,
            self.nets.policy.forward_is_deterministic(),
        )
        log.info(
            "trainer: old log-probs %s",
            "from the update's own forward (one update per step)"
            if self.reuse_training_forward
            else "recomputed before the update",
        )

    def run(self) -> int:
        while self.progress.step < self.settings.total_steps:
            with self.timer.phase("wait_for_batch"):
                groups = self.next_batch()
            if groups is None:
                return self.stop_with_checkpoint()
            step_metrics = self.train_step(groups)
            step_metrics.update(self.publish())
            self.maybe_checkpoint()
            self.log(step_metrics)
            if self.stop.agreed():
                return self.stop_with_checkpoint()
        self.checkpoint()
        return exitcodes.DONE

    # --- the phases ----------------------------------------------------------------------------
    def next_batch(self) -> list | None:
        """The next step's groups on every rank, or None when a stop was requested."""
        while True:
            groups = None
            if self.reader is not None:
                try:
                    groups = self.reader.next_batch(
                        self.settings.prompts_per_step,
                        self.progress.policy_version,
                        timeout_s=BATCH_WAIT_S,
                    )
                except SpoolTimeout:
                    groups = None
            if self.stop.agreed():
                return None
            groups = self.broadcast_groups(groups)
            if groups is not None:
                return groups
            self.on_idle()

    def train_step(self, groups: list) -> dict[str, float]:
        s = self.settings
        batch = collate(groups, s.pad_token_id, self.media_processor)
        trained, failures = mask_failed_rewards(self.spec, batch)
        if bool(trained.response_mask_BT.any()):
            metrics = self.update(trained)
        else:  # an update without a gradient would still move the weights (momentum)
            log.warning("trainer: no sample of this step has a reward; it trains nothing")
            metrics = {}
        self.progress.step += 1
        self.progress.failed_samples += int(failures["rewards/failed_samples"])
        self.progress.dropped_groups += int(failures["rewards/dropped_groups"])
        metrics.update(failures)
        self.progress.samples += batch.num_samples
        self.progress.tokens += batch.num_tokens
        if s.audit_sample_ids:
            self.progress.sample_ids.append(list(batch.sample_ids))
        if self.reader is not None:
            self.reader.mark_step_consumed(self.progress.step)
        metrics.update(self.batch_metrics(batch))
        return metrics

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """The step's optimiser updates on ``batch``; their metrics."""
        s = self.settings
        plan = (s.epochs_per_step, s.mini_batches_per_step, s.rank, s.world_size)
        with self.timer.phase("prepare"):
            tensors = prepare_step(
                self.spec, batch, self.nets, s.temperature, self.reuse_training_forward
            )
        with self.timer.phase("train"):
            metrics = update_policy(
                self.spec, batch, tensors, self.nets.policy, plan, s.temperature
            )
            if self.nets.critic is not None:
                metrics.update(update_critic(self.spec, batch, tensors, self.nets.critic, plan))
        return metrics

    def publish(self) -> dict[str, float]:
        step = self.progress.step
        if step % self.settings.sync_interval_steps and step != self.settings.total_steps:
            return {}
        with self.timer.phase("weight_sync"):
            return self.publish_weights(self.progress.policy_version)

    def maybe_checkpoint(self) -> None:
        if self.progress.step % self.settings.checkpoint_interval_steps == 0:
            self.checkpoint()

    def checkpoint(self) -> None:
        """Save this step, unless it is saved already (the last periodic checkpoint is
        also the final one when ``total_steps`` is a multiple of the interval)."""
        step = self.progress.step
        if step == self.checkpointed_step:
            return
        with self.timer.phase("checkpoint"):
            state = self.checkpoint_state(self.store.partial_dir(step), saving=True)
            saved = self.store.save(step, state, facts={"policy_version": step})
            log.info("trainer: checkpoint of step %d saved to %s", step, saved)
            if self.reader is not None:
                self.reader.on_checkpoint_complete(step)
        self.checkpointed_step = step

    def resume(self, info: CheckpointInfo) -> None:
        """Load a complete checkpoint (before ``run``)."""
        self.store.load(info, self.checkpoint_state(info.path, saving=False))
        self.checkpointed_step = self.progress.step

    def checkpoint_state(self, step_dir: Path, saving: bool) -> dict:
        """``Stateful`` entries of a checkpoint: the loop's own (progress, RNG, the spool
        ledger on rank 0) and the backend's (networks, optimisers, schedulers)."""
        state = {"progress": OpaqueState(self.progress), "rng": OpaqueState(RngState())}
        state.update(self.backend.checkpoint_entries(step_dir, saving))
        if self.reader is not None:
            state["spool"] = OpaqueState(self.reader)
        return state

    def stop_with_checkpoint(self) -> int:
        log.info("trainer: stopping at step %d (%s)", self.progress.step, self.stop.reason)
        self.checkpoint()
        return exitcodes.STOPPED

    def log(self, step_metrics: dict[str, float]) -> None:
        metrics = {_tb_name(k): v for k, v in step_metrics.items()}
        metrics.update(self.timer.pop())
        if self.reader is not None:
            metrics.update({f"spool/{k}": v for k, v in self.reader.metrics().items()})
        metrics.update(self.cost_metrics(self.progress.step))
        self.progress.history.append(
            {
                "step": self.progress.step,
                "reward": metrics.get("reward/mean", 0.0),
                "time": time.time(),
            }
        )
        self.metrics.log(
            self.progress.step, metrics, extra={"policy_version": self.progress.policy_version}
        )
        if not self.log_lines.due(force=self.progress.step >= self.settings.total_steps):
            return
        log.info(
            "step %d/%d reward %.3f loss %.4f staleness %.2f",
            self.progress.step,
            self.settings.total_steps,
            metrics.get("reward/mean", 0.0),
            metrics.get("loss/actor", 0.0),
            metrics.get("staleness/mean", 0.0),
        )

    def batch_metrics(self, batch: TrainBatch) -> dict[str, float]:
        rewards = batch.rewards_B  # of the samples whose reward was computed
        if batch.reward_failed_B is not None and bool(batch.reward_failed_B.any()):
            rewards = rewards[~batch.reward_failed_B]
        if rewards.numel() == 0:
            rewards = torch.zeros(1)
        response_len = batch.response_len_B.float()
        staleness = (self.progress.policy_version - 1 - batch.policy_version_B).float()
        return {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "reward/accuracy": float((rewards > 0.5).float().mean()),
            "response/length_mean": float(response_len.mean()),
            "response/length_max": float(response_len.max()),
            # The model's own tokens: multi-turn responses also hold observation tokens.
            "response/model_tokens_mean": float(batch.response_mask_BT.sum(-1).mean()),
            "staleness/mean": float(staleness.mean()),
            "staleness/max": float(staleness.max()),
            "progress/samples": float(self.progress.samples),
            "progress/tokens": float(self.progress.tokens),
            "rewards/failed_samples_total": float(self.progress.failed_samples),
            "rewards/dropped_groups_total": float(self.progress.dropped_groups),
        }


def _tb_name(name: str) -> str:
    """algo metric names (``pg_clipfrac``) go under ``actor/``; others keep their prefix."""
    return name if "/" in name else f"actor/{name}"


def sequential_broadcast(groups):
    """Single-rank stand-in for ``broadcast_groups``."""
    return groups


def torch_broadcast_groups(rank: int, group=None):
    """Rank 0's groups to every rank (a pickled object broadcast over the trainer's group)."""
    import torch.distributed as dist

    def broadcast(groups):
        box = [groups if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return broadcast
