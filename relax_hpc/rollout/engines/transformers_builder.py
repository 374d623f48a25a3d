"""``rollout.backend=transformers``: the policy (or a judge) as a transformers model in this
process, on the CPU or one GPU; a model that reads images or audio gets the media engine.

Must not: import SGLang.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relax_hpc.config import RunConfig
from relax_hpc.config.schema import JudgeConfig, ModelConfig
from relax_hpc.models.build import build_causal_lm, build_tokenizer, resolve_dtype
from relax_hpc.models.media_policy import build_media_policy, is_media_model
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.base import Engine
from relax_hpc.rollout.engines.builder import EngineBuilder, JudgeEngine, PolicyEngine
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.weightsync.receiver import LoadFn


def media_warm_start(cfg: RunConfig) -> Path | None:
    """The folder of a media policy's warm start (``model.warm_start``, built from config),
    which the trainer loads too: the run's task's (``tasks.registry``)."""
    if not cfg.model.warm_start or cfg.model.path is not None:
        return None
    from relax_hpc.tasks.registry import policy_warm_start

    return policy_warm_start(cfg.model, cfg.data, cfg.rollout.environment)


class TransformersBuilder(EngineBuilder):
    def build_policy(self, cfg: RunConfig, device: torch.device) -> PolicyEngine:
        dtype = resolve_dtype(cfg.model.dtype, device)
        if is_media_model(cfg.model):
            model, processor = build_media_policy(
                cfg.model, dtype, seed=cfg.seed, warm_start_folder=media_warm_start(cfg)
            )
            engine = MediaTransformersEngine(model.to(device), processor)
            return engine, processor.tokenizer, processor
        tokenizer = build_tokenizer(cfg.model)
        model = build_causal_lm(cfg.model, tokenizer, dtype, seed=cfg.seed)
        return TransformersEngine(model.to(device), tokenizer), tokenizer, None

    def weight_loader(self, engine: Engine, paths: RunPaths) -> tuple[LoadFn, int | None]:
        assert isinstance(engine, TransformersEngine)
        return engine.load_weights, None  # every version comes through the receiver

    def build_judge(
        self,
        judge: JudgeConfig,
        model: ModelConfig,
        tokenizer: Any,
        device: torch.device,
        seed: int,
    ) -> JudgeEngine:
        dtype = resolve_dtype(model.dtype, device)
        network = build_causal_lm(model, tokenizer, dtype, seed=seed)
        network.requires_grad_(False)  # frozen: never trained, never synced
        engine = TransformersEngine(network.to(device), tokenizer, max_batch_size=judge.batch_size)
        return engine, getattr(network.config, "max_position_embeddings", None)
