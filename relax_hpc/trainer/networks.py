"""The Hugging Face networks a run trains from, before any backend converts them.

The policy starts from the configured model (or its cached warm start); the reference
and the critic's body from their own paths, else from a copy of the policy; the teacher
from its path. Which of them a run needs follows from the algorithm (``AlgorithmSpec``).
A model that reads images or audio (``model.modality``) is built by
``models.media_policy``, as the rollout builds it, with its ``MediaProcessor``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any

import torch

from relax_hpc.algo import AlgorithmSpec
from relax_hpc.config import ModelConfig, RunConfig
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.models.media_policy import build_media_policy, is_media_model, load_media_policy
from relax_hpc.observe.metrics import WarmStartStatus
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.backend import HFNetworks


def initial_model_config(cfg: RunConfig) -> ModelConfig:
    """The policy's starting point: the configured model, or the cached warm start of the
    run's task (``tasks.registry.policy_task``)."""
    if not cfg.model.warm_start:
        return cfg.model
    from relax_hpc.tasks.registry import policy_warm_start
    from relax_hpc.tasks.warm_start import warm_started_model_config

    with warm_start_progress(cfg):
        folder = policy_warm_start(cfg.model, cfg.data, cfg.rollout.environment)
    return warm_started_model_config(cfg.model, folder)


def warm_start_progress(cfg: RunConfig) -> contextlib.AbstractContextManager:
    """A warm start trained inside reports to the run's status: the console's progress line
    shows it before step 1 (``launch/summary.py``)."""
    from relax_hpc.tasks.warm_start import progress_reports

    if not cfg.run_dir:
        return contextlib.nullcontext()
    return progress_reports(WarmStartStatus(RunPaths(cfg.run_dir).warm_start_status))


def hf_networks(cfg: RunConfig, spec: AlgorithmSpec, dtype: torch.dtype) -> tuple[HFNetworks, Any]:
    """The networks ``spec`` needs, and the policy's tokenizer (which every one shares)."""
    if is_media_model(cfg.model):
        return media_networks(cfg, spec, dtype)
    model_cfg = initial_model_config(cfg)
    tokenizer = build_tokenizer(model_cfg)
    policy = build_causal_lm(model_cfg, tokenizer, dtype, seed=cfg.seed)

    def from_path_or_copy(path: str | None, initial: torch.nn.Module | None):
        """The model at ``path``, else a copy of ``initial``. Models from a path share the
        policy's tokenizer: their vocabularies must match."""
        if path is None:
            return copy.deepcopy(initial)
        path_cfg = dataclasses.replace(cfg.model, path=path, tokenizer="auto", arch={})
        return build_causal_lm(path_cfg, tokenizer, dtype)

    networks = HFNetworks(
        policy=policy,
        reference=from_path_or_copy(cfg.model.reference_path, policy)
        if spec.needs_reference
        else None,
        teacher=from_path_or_copy(cfg.model.teacher_path, None) if spec.needs_teacher else None,
        critic_body=from_path_or_copy(cfg.model.critic_path, policy) if spec.needs_critic else None,
    )
    return networks, tokenizer


def media_networks(
    cfg: RunConfig, spec: AlgorithmSpec, dtype: torch.dtype
) -> tuple[HFNetworks, Any]:
    """``hf_networks`` of a VL/Omni policy: networks from a path are media models of that
    folder (they share the policy's processor, so their media inputs must match)."""
    from relax_hpc.tasks.registry import policy_warm_start

    folder = None
    if cfg.model.warm_start and cfg.model.path is None:
        with warm_start_progress(cfg):
            folder = policy_warm_start(cfg.model, cfg.data, cfg.rollout.environment)
    policy, processor = build_media_policy(
        cfg.model, dtype, seed=cfg.seed, warm_start_folder=folder
    )

    def from_path_or_copy(field: str, initial: torch.nn.Module | None):
        path = getattr(cfg.model, field)
        if path is None:
            return copy.deepcopy(initial)
        return load_media_policy(path, dtype, f"model.{field}")[0]

    networks = HFNetworks(
        policy=policy,
        reference=from_path_or_copy("reference_path", policy) if spec.needs_reference else None,
        teacher=from_path_or_copy("teacher_path", None) if spec.needs_teacher else None,
        critic_body=from_path_or_copy("critic_path", policy) if spec.needs_critic else None,
        processor=processor,
    )
    return networks, processor.tokenizer
