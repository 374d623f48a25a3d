"""Wiring of the trainer role: build everything from the resolved config, resume, run.

Called by ``relax_hpc.component trainer``; returns the process exit code. Knows no
backend: ``make_backend`` picks one (``trainer/backend.py``), everything else goes through
its interface.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from relax_hpc import exitcodes
from relax_hpc.algo import resolve
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointStore, latest_checkpoint
from relax_hpc.config import RunConfig
from relax_hpc.config.weightsync import run_backend
from relax_hpc.garbage import settle_after_startup
from relax_hpc.models.build import resolve_dtype
from relax_hpc.observe.cost import StepCostMetrics
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths, atomic_write_json
from relax_hpc.runtime import TaskIdentity
from relax_hpc.spool import SpoolReader
from relax_hpc.trainer.backend import TrainerBackend, make_backend
from relax_hpc.trainer.group import init_trainer_group, leave_group_and_exit
from relax_hpc.trainer.loop import (
    LoopSettings,
    Trainer,
    sequential_broadcast,
    torch_broadcast_groups,
)
from relax_hpc.trainer.networks import hf_networks
from relax_hpc.trainer.publish import BackgroundPublisher, ChildPublisher
from relax_hpc.weightsync import make_weight_sender
from relax_hpc.weightsync.sender_process import SenderProcess

log = logging.getLogger(__name__)
HISTORY_SUMMARY_STEPS = 5  # steps averaged for the start and end of the reward curve


def make_sender(cfg: RunConfig, paths: RunPaths, device: torch.device, identity: TaskIdentity):
    """Rank 0's weight sender, on the backend the run's layout needs (see ``run_backend``):
    in a process of its own where it sends in the background over Gloo (``send_process``)."""
    backend = run_backend(cfg.weightsync, device.type == "cuda")
    weightsync = dataclasses.replace(cfg.weightsync, backend=backend)
    if sends_from_process(cfg, backend):
        return SenderProcess(paths, weightsync, device, identity.attempt)
    return make_weight_sender(paths, weightsync, device, identity.attempt)


def sends_from_process(cfg: RunConfig, backend: str) -> bool:
    """Whether the trainer's sender runs in a child process (``weightsync.send_process``):
    only for a background send of host buckets over Gloo, and only where the weights can
    be shared through a memfd (Linux; elsewhere, a laptop's macOS, the thread sends)."""
    w = cfg.weightsync
    background = w.background_send and cfg.mode == "async"
    process = w.send_process and hasattr(os, "memfd_create")
    return background and process and w.transport == "buckets" and backend == "gloo"


def build_backend(cfg: RunConfig, device: torch.device, identity: TaskIdentity):
    """The algorithm, the policy's tokenizer, the backend with its networks built, and the
    policy's ``MediaProcessor`` (None for a text model)."""
    spec = resolve(cfg.algo)
    dtype = resolve_dtype(cfg.model.dtype, device)
    networks, tokenizer = hf_networks(cfg, spec, dtype)
    backend = make_backend(cfg.trainer, device, dtype, identity.rank, identity.world_size)
    backend.build_networks(networks)
    return spec, tokenizer, backend, networks.processor


def run_trainer(cfg: RunConfig, paths: RunPaths, identity: TaskIdentity) -> int:
    torch.set_num_threads(cfg.trainer.torch_threads)
    device = torch.device(f"cuda:{identity.local_rank}" if cfg.trainer.gpus_per_node else "cpu")
    init_trainer_group(
        paths, identity, "nccl" if device.type == "cuda" else "gloo", cfg.weightsync.timeout_s * 5
    )
    exit_code = _train(cfg, paths, identity, device)
    if identity.world_size > 1:  # only after a normal return: a crash leaves by its traceback
        leave_group_and_exit(exit_code)
    return exit_code


def _train(cfg: RunConfig, paths: RunPaths, identity: TaskIdentity, device: torch.device) -> int:
    stop = StopFlag(cancel_request=paths.cancel_request).install()
    leader = identity.rank == 0
    if leader:
        paths.trainer_done.unlink(missing_ok=True)  # from an earlier completion of this run
    sender = make_sender(cfg, paths, device, identity) if leader else None
    if sender is not None:
        sender.start()  # before the model is built: rollout engines can register meanwhile
    spec, tokenizer, backend, processor = build_backend(cfg, device, identity)
    reader = (
        SpoolReader(
            paths.spool_dir,
            dataclasses.replace(cfg.spool, max_staleness=cfg.max_staleness),
            # woken by a rollout's nudge when it published (spool.poll_s: the fallback)
            sleep=sender.wait_for_engines if sender is not None else time.sleep,
        )
        if leader
        else None
    )
    metrics = MetricsLogger(
        paths.trainer_tensorboard_dir if leader else None,
        paths.trainer_status if leader else None,
        status_in_background=True,  # off the step's path (observe/metrics.py)
    )

    def sync(weights, policy_version: int, only: list[str] | None) -> dict[str, float]:
        return sync_metrics(sender.sync(weights, policy_version, only))

    publisher = background_publisher(cfg, sync, sender)

    def publish_weights(policy_version: int, only: list[str] | None = None) -> dict[str, float]:
        weights = backend.policy_weights()  # collective
        if sender is None:
            return {}
        if publisher is None:
            return sync(weights, policy_version, only)
        if only is None:
            return publisher.publish(weights, policy_version)
        return publisher.publish_now(weights, policy_version, only)

    trainer = Trainer(
        settings=_settings(cfg, tokenizer, backend),
        spec=spec,
        backend=backend,
        reader=reader,
        publish_weights=publish_weights,
        store=CheckpointStore(
            paths, cfg.trainer.checkpoint_keep, identity.rank, _barrier(identity)
        ),
        stop=stop,
        metrics=metrics,
        broadcast_groups=torch_broadcast_groups(identity.rank)
        if identity.world_size > 1
        else sequential_broadcast,
        cost_metrics=StepCostMetrics(paths) if leader else lambda step: {},
        media_processor=processor,
        on_idle=lambda: _catch_up_joiners(sender, trainer, publish_weights, publisher),
    )
    _resume_or_start(cfg, paths, trainer)
    publish_weights(trainer.progress.policy_version)
    settle_after_startup()
    exit_code = trainer.run()
    metrics.close()  # the last step's status on disk before anything says the run ended
    if publisher is not None:
        publisher.close()  # the last version reaches the engines before the sender closes
    if exit_code == exitcodes.DONE:
        # a media model's processor writes its tokenizer and preprocessor_config.json
        backend.export(paths.export_dir, processor or tokenizer, is_writer=leader)  # collective
        if leader:
            _finish(paths, trainer)
    elif exit_code == exitcodes.STOPPED and leader:
        _write_audit(paths, trainer)  # what the stop's checkpoint holds, for the tests
    if sender is not None:
        sender.close()
    return exit_code


def background_publisher(
    cfg: RunConfig, sync, sender=None
) -> BackgroundPublisher | ChildPublisher | None:
    """``weightsync.background_send``'s publisher, in async mode only: sync and hybrid
    modes wait for each version before generating with it, so a send beside training would
    gain nothing there (said once, so that the setting is not silently ignored). Over a
    sender in a child process (``send_process``) it needs no thread."""
    if not cfg.weightsync.background_send:
        return None
    if cfg.mode != "async":
        log.info("weightsync: background_send has no effect in mode=%s (async only)", cfg.mode)
        return None
    if isinstance(sender, SenderProcess):
        return ChildPublisher(sender, sync_metrics)
    return BackgroundPublisher(sync)


def sync_metrics(report) -> dict[str, float]:
    """A ``SyncReport``'s figures for TensorBoard."""
    return {
        "weightsync/seconds": report.seconds,
        "weightsync/engines": float(len(report.members)),
        "weightsync/dropped": float(len(report.dropped)),
    }


def _catch_up_joiners(sender, trainer: Trainer, publish_weights, publisher=None) -> None:
    """Send the current weights to engines that registered while the trainer waits for
    samples (on every rank: the weights are a collective). Without this a restarted worker
    holding the claims of the very batch the trainer waits for would wait for weights that
    only come after that batch: neither side would move. A send in flight ends first: the
    sender serves one thread at a time."""
    if publisher is not None:
        publisher.wait()
    joiners = sender.admit_joiners() if sender is not None else []
    joiners = trainer.broadcast_groups(joiners)
    if joiners:
        version = trainer.progress.policy_version
        log.info("trainer: %s joined while waiting for samples: sending policy_version %d",
                 ", ".join(joiners), version)  # fmt: skip
        publish_weights(version, joiners)


def _settings(cfg: RunConfig, tokenizer, backend: TrainerBackend) -> LoopSettings:
    rank, world_size = backend.data_parallel_layout()
    return LoopSettings(
        total_steps=cfg.trainer.total_steps,
        prompts_per_step=cfg.rollout.prompts_per_step,
        checkpoint_interval_steps=cfg.trainer.checkpoint_interval_steps,
        sync_interval_steps=cfg.weightsync.interval_steps,
        epochs_per_step=cfg.trainer.epochs_per_step,
        mini_batches_per_step=cfg.trainer.mini_batches_per_step,
        temperature=cfg.rollout.temperature,
        pad_token_id=tokenizer.pad_token_id,
        rank=rank,
        world_size=world_size,
        audit_sample_ids=cfg.observe.audit_sample_ids,
    )


def _resume_or_start(cfg: RunConfig, paths: RunPaths, trainer: Trainer) -> None:
    """Load the latest complete checkpoint (resume=auto).

    The current policy is published next: with no engine admitted yet, the sync falls back
    to ``weights/v<N>/``, where a starting rollout engine loads it from.
    """
    info = latest_checkpoint(paths) if cfg.resume == "auto" else None
    if info is None:
        log.info("trainer: starting from the initial policy (version 0)")
        return
    trainer.resume(info)
    log.info("trainer: resumed from %s (step %d)", info.path, info.step)


def _finish(paths: RunPaths, trainer: Trainer) -> None:
    """Mark the run finished (after the export): the summary and the audit."""
    summary = {
        "step": trainer.progress.step,
        "samples": trainer.progress.samples,
        "export_dir": str(paths.export_dir),
        "history_head": trainer.progress.history[:HISTORY_SUMMARY_STEPS],
        "history_tail": trainer.progress.history[-HISTORY_SUMMARY_STEPS:],
    }
    _write_audit(paths, trainer)
    atomic_write_json(paths.trainer_done, summary)


def _write_audit(paths: RunPaths, trainer: Trainer) -> None:
    if trainer.progress.sample_ids:
        atomic_write_json(paths.consumed_sample_ids, trainer.progress.sample_ids)


def _barrier(identity: TaskIdentity):
    if identity.world_size == 1:
        return lambda: None
    import torch.distributed as dist

    return dist.barrier
