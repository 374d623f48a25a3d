"""Wiring of the trainer role: build everything from the resolved config, resume, run.

Called by ``relax_hpc.component trainer``; returns the process exit code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from relax_hpc.algo import resolve
from relax_hpc.checkpoint.stateful import ModelAndOptimizer, OpaqueState, RngState
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointStore, latest_checkpoint
from relax_hpc.config import RunConfig
from relax_hpc.config.weightsync import run_backend
from relax_hpc.models.build import build_causal_lm, build_tokenizer, resolve_dtype
from relax_hpc.observe.cost import step_cost_metrics
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths, atomic_write_json
from relax_hpc.runtime import TaskIdentity
from relax_hpc.spool import SpoolReader
from relax_hpc.trainer.group import init_trainer_group
from relax_hpc.trainer.loop import (
    LoopSettings,
    Trainer,
    sequential_broadcast,
    torch_broadcast_groups,
)
from relax_hpc.trainer.torch_backend import TorchModel, ValueHead, frozen_copy, shard_with_fsdp2
from relax_hpc.trainer.update import Networks
from relax_hpc.weightsync import make_weight_sender

log = logging.getLogger(__name__)
HISTORY_SUMMARY_STEPS = 5  # steps averaged for the start and end of the reward curve


def cache_dir() -> Path:
    return Path(os.environ.get("RELAX_HPC_CACHE_DIR", Path.home() / ".cache" / "relax_hpc"))


def initial_model_config(cfg: RunConfig):
    """The policy's starting point: the configured model, or its cached warm start."""
    if not cfg.model.warm_start:
        return cfg.model
    from relax_hpc.models.warmstart import warm_start, warm_started_model_config

    folder = warm_start(cfg.model, cfg.data, cache_dir())
    return warm_started_model_config(cfg.model, folder)


def _from_path_or_copy(cfg: RunConfig, path: str | None, initial, tokenizer, dtype):
    """The model at ``path`` (reference, critic body, teacher), else a copy of ``initial``.

    Models from a path share the policy's tokenizer: their vocabularies must match.
    """
    if path is None:
        return frozen_copy(initial)
    model_cfg = dataclasses.replace(cfg.model, path=path, tokenizer="auto", arch={})
    return build_causal_lm(model_cfg, tokenizer, dtype)


def make_sender(cfg: RunConfig, paths: RunPaths, device: torch.device, identity: TaskIdentity):
    """Rank 0's weight sender, on the backend the run's layout needs (see ``run_backend``)."""
    backend = run_backend(cfg.weightsync, device.type == "cuda")
    weightsync = dataclasses.replace(cfg.weightsync, backend=backend)
    return make_weight_sender(paths, weightsync, device, identity.attempt)


def build_networks(cfg: RunConfig, device: torch.device, world_size: int):
    spec = resolve(cfg.algo)
    model_cfg = initial_model_config(cfg)
    tokenizer = build_tokenizer(model_cfg)
    dtype = resolve_dtype(cfg.model.dtype, device)
    policy_net = build_causal_lm(model_cfg, tokenizer, dtype, seed=cfg.seed)
    reference_net = (
        _from_path_or_copy(cfg, cfg.model.reference_path, policy_net, tokenizer, dtype)
        if spec.needs_reference
        else None
    )
    critic_body = (  # the causal LM whose body the critic starts from
        _from_path_or_copy(cfg, cfg.model.critic_path, policy_net, tokenizer, dtype)
        if spec.needs_critic
        else None
    )
    teacher_net = None
    if spec.needs_teacher:
        teacher_net = _from_path_or_copy(cfg, cfg.model.teacher_path, None, tokenizer, dtype)
    if cfg.trainer.backend == "megatron":
        from relax_hpc.trainer.megatron.backend import megatron_networks

        hf_networks = {
            "policy": policy_net,
            "reference": reference_net,
            "teacher": teacher_net,
            "critic": critic_body,
        }
        return spec, tokenizer, megatron_networks(cfg.trainer, device, dtype, hf_networks)
    critic_net = ValueHead(critic_body).to(dtype) if critic_body is not None else None
    if world_size > 1:
        policy_net = shard_with_fsdp2(policy_net)
        critic_net = shard_with_fsdp2(critic_net) if critic_net is not None else None
    t = cfg.trainer
    common = {"device": device, "micro_batch_tokens": t.micro_batch_tokens}
    nets = Networks(
        policy=TorchModel(
            policy_net,
            lr=t.lr,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps,
            grad_clip=t.grad_clip,
            **common,
        ),
        reference=TorchModel(reference_net, trainable=False, **common) if reference_net else None,
        teacher=TorchModel(teacher_net, trainable=False, **common) if teacher_net else None,
        critic=TorchModel(
            critic_net, lr=t.critic_lr, warmup_steps=t.warmup_steps, grad_clip=t.grad_clip, **common
        )
        if critic_net
        else None,
    )
    return spec, tokenizer, nets


def full_policy_weights(policy: torch.nn.Module, world_size: int) -> dict[str, torch.Tensor]:
    """HF-named tensors of the whole policy (collective under FSDP2; every rank calls it)."""
    if world_size == 1:
        return {k: v.detach() for k, v in policy.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def policy_weights(cfg: RunConfig, nets: Networks, world_size: int) -> dict[str, torch.Tensor]:
    """HF-named tensors of the whole policy for weight sync (collective; every rank calls it)."""
    if cfg.trainer.backend == "megatron":
        return nets.policy.hf_state_dict()
    return full_policy_weights(nets.policy.network, world_size)


def run_trainer(cfg: RunConfig, paths: RunPaths, identity: TaskIdentity) -> int:
    torch.set_num_threads(cfg.trainer.torch_threads)
    device = torch.device(f"cuda:{identity.local_rank}" if cfg.trainer.gpus_per_node else "cpu")
    init_trainer_group(
        paths, identity, "nccl" if device.type == "cuda" else "gloo", cfg.weightsync.timeout_s * 5
    )
    stop = StopFlag(cancel_request=paths.cancel_request).install()
    leader = identity.rank == 0
    if leader:
        paths.trainer_done.unlink(missing_ok=True)  # from an earlier completion of this run
    sender = make_sender(cfg, paths, device, identity) if leader else None
    if sender is not None:
        sender.start()  # before the model is built: rollout engines can register meanwhile
    spec, tokenizer, nets = build_networks(cfg, device, identity.world_size)
    reader = (
        SpoolReader(
            paths.spool_dir, dataclasses.replace(cfg.spool, max_staleness=cfg.max_staleness)
        )
        if leader
        else None
    )
    metrics = MetricsLogger(
        paths.tensorboard_dir / "trainer" if leader else None,
        paths.status_dir / "trainer.json" if leader else None,
    )
    store = CheckpointStore(paths, cfg.trainer.checkpoint_keep, identity.rank, _barrier(identity))

    def publish_weights(policy_version: int) -> dict[str, float]:
        weights = policy_weights(cfg, nets, identity.world_size)
        if sender is None:
            return {}
        report = sender.sync(weights, policy_version)
        return {
            "weightsync/seconds": report.seconds,
            "weightsync/engines": float(len(report.members)),
            "weightsync/dropped": float(len(report.dropped)),
        }

    trainer = Trainer(
        settings=_settings(cfg, tokenizer, identity),
        spec=spec,
        nets=nets,
        reader=reader,
        publish_weights=publish_weights,
        store=store,
        checkpoint_state=lambda: _checkpoint_state(
            nets,
            trainer.progress,
            reader,
            megatron_entries_to_save(cfg, nets, paths, trainer.progress.step),
        ),
        stop=stop,
        metrics=metrics,
        broadcast_groups=torch_broadcast_groups(identity.rank)
        if identity.world_size > 1
        else sequential_broadcast,
        cost_metrics=(lambda step: step_cost_metrics(paths, step)) if leader else lambda step: {},
    )
    _resume_or_publish_initial(cfg, paths, store, trainer, nets, reader, publish_weights)
    exit_code = trainer.run()
    if exit_code == 0:
        export_policy(cfg, paths, nets, tokenizer, identity)  # collective
        if leader:
            _finish(paths, trainer)
    metrics.close()
    if sender is not None:
        sender.close()
    return exit_code


def _settings(cfg: RunConfig, tokenizer, identity: TaskIdentity) -> LoopSettings:
    rank, world_size = data_parallel_layout(cfg, identity)
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


def data_parallel_layout(cfg: RunConfig, identity: TaskIdentity) -> tuple[int, int]:
    """(rank, world_size) the update splits rows by: every rank for torch (FSDP2 is pure data
    parallel), Megatron's data-parallel group for megatron (a TP group trains the same rows)."""
    if cfg.trainer.backend != "megatron":
        return identity.rank, identity.world_size
    from relax_hpc.trainer.megatron.wiring import data_parallel_layout as megatron_layout

    return megatron_layout()


def megatron_entries_to_save(cfg: RunConfig, nets: Networks, paths: RunPaths, step: int):
    """The checkpoint entries Megatron writes itself (``MegatronModelState``: the policy and
    the critic); None for torch."""
    if cfg.trainer.backend != "megatron":
        return None
    from relax_hpc.trainer.megatron.wiring import MegatronModelState

    return {
        role: MegatronModelState.for_save(model, paths, step, role)
        for role, model in (("policy", nets.policy), ("critic", nets.critic))
        if model is not None
    }


def megatron_entries_to_load(cfg: RunConfig, nets: Networks, checkpoint_path: Path):
    if cfg.trainer.backend != "megatron":
        return None
    from relax_hpc.trainer.megatron.wiring import MegatronModelState

    return {
        role: MegatronModelState.for_load(model, checkpoint_path, role)
        for role, model in (("policy", nets.policy), ("critic", nets.critic))
        if model is not None
    }


def _checkpoint_state(nets: Networks, progress, reader, megatron_entries=None) -> dict:
    """Stateful entries of a checkpoint; ``megatron_entries`` from ``megatron_entries_to_*``
    (Megatron's own checkpoints hold their optimisers and schedulers)."""
    state = {"progress": OpaqueState(progress), "rng": OpaqueState(RngState())}
    if megatron_entries is not None:
        state.update(megatron_entries)
    else:
        state["policy"] = ModelAndOptimizer(nets.policy.network, nets.policy.optimizer)
        state["scheduler"] = OpaqueState(nets.policy.scheduler)
        if nets.critic is not None:
            state["critic"] = ModelAndOptimizer(nets.critic.network, nets.critic.optimizer)
    if reader is not None:
        state["spool"] = OpaqueState(reader)
    return state


def _resume_or_publish_initial(cfg, paths, store, trainer, nets, reader, publish_weights) -> None:
    """Load the latest complete checkpoint (resume=auto), then publish the current policy.

    With no engine admitted yet, the sync falls back to ``weights/v<N>/``, where a
    starting rollout engine loads it from.
    """
    info = latest_checkpoint(paths) if cfg.resume == "auto" else None
    if info is None:
        log.info("trainer: starting from the initial policy (version 0)")
    else:
        megatron_entries = megatron_entries_to_load(cfg, nets, info.path)
        store.load(info, _checkpoint_state(nets, trainer.progress, reader, megatron_entries))
        log.info("trainer: resumed from %s (step %d)", info.path, info.step)
    publish_weights(trainer.progress.policy_version)


def export_policy(
    cfg: RunConfig, paths: RunPaths, nets: Networks, tokenizer, identity: TaskIdentity
) -> None:
    """The final policy as a Hugging Face folder (collective; rank 0 writes)."""
    leader = identity.rank == 0
    if cfg.trainer.backend == "megatron":
        from relax_hpc.trainer.megatron import wiring as megatron_wiring

        megatron_wiring.export_policy(nets.policy, tokenizer, paths.export_dir, leader)
        return
    weights = full_policy_weights(nets.policy.network, identity.world_size)
    if leader:
        nets.policy.network.save_pretrained(
            paths.export_dir, state_dict=weights, safe_serialization=True
        )
        tokenizer.save_pretrained(paths.export_dir)


def _finish(paths: RunPaths, trainer: Trainer) -> None:
    """Mark the run finished (after ``export_policy``): the summary and the audit."""
    summary = {
        "step": trainer.progress.step,
        "samples": trainer.progress.samples,
        "export_dir": str(paths.export_dir),
        "history_head": trainer.progress.history[:HISTORY_SUMMARY_STEPS],
        "history_tail": trainer.progress.history[-HISTORY_SUMMARY_STEPS:],
    }
    if trainer.progress.sample_ids:
        atomic_write_json(
            paths.status_dir / "consumed_sample_ids.json", trainer.progress.sample_ids
        )
    atomic_write_json(paths.trainer_done, summary)


def _barrier(identity: TaskIdentity):
    if identity.world_size == 1:
        return lambda: None
    import torch.distributed as dist

    return dist.barrier
