"""``rollout.backend=sglang``: the policy (or a judge) served by SGLang on GPUs, one engine per
tensor-parallel group; the engine starts from the newest published weights.

Several engines on one node each take their own GPUs and ports: engine k of a node serves
at ``SGLANG_BASE_PORT + 16 * first_gpu``, its judge ``JUDGE_PORT_OFFSET`` above.

Must not: import SGLang at module level (``sglang_engine`` imports it when an engine starts).
"""

from __future__ import annotations

from typing import Any

import torch

from relax_hpc.config import RunConfig
from relax_hpc.config.schema import JudgeConfig, ModelConfig
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.build import build_tokenizer, resolve_dtype
from relax_hpc.models.media_policy import is_media_model
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.base import Engine
from relax_hpc.rollout.engines.builder import (
    EngineBuilder,
    JudgeEngine,
    PolicyEngine,
    colocated,
)
from relax_hpc.rollout.engines.sglang_engine import SGLangEngine
from relax_hpc.rollout.sglang_weights import SGLangWeightLoader
from relax_hpc.weightsync.receiver import LoadFn

SGLANG_BASE_PORT = 30000  # SGLang's default; engine k of a node offsets it
PORTS_PER_ENGINE = 16
JUDGE_PORT_OFFSET = 8  # engine k of a node: the policy at base + 16k, its judge at + 8


def server_ports(first_gpu: int, offset: int = 0) -> dict[str, int]:
    """The HTTP and NCCL ports of the engine whose first GPU is ``first_gpu``: explicit,
    else SGLang picks port + a random 100..1000 and engines 16 ports apart could clash."""
    port = SGLANG_BASE_PORT + PORTS_PER_ENGINE * first_gpu + offset
    return {"base_gpu_id": first_gpu, "port": port, "nccl_port": port + 1}


def serve_dtype(model: ModelConfig) -> str:
    """``model.dtype`` on a GPU (auto = bf16), as SGLang spells it."""
    return str(resolve_dtype(model.dtype, "cuda")).removeprefix("torch.")


class SGLangBuilder(EngineBuilder):
    def build_policy(self, cfg: RunConfig, device: torch.device) -> PolicyEngine:
        engine = build_sglang_engine(cfg, device.index or 0)
        processor = engine.media_processor
        return engine, processor.tokenizer if processor else build_tokenizer(cfg.model), processor

    def weight_loader(self, engine: Engine, paths: RunPaths) -> tuple[LoadFn, int | None]:
        """SGLang starts from the newest published ``weights/v{N}/``, read by SGLang itself."""
        assert isinstance(engine, SGLangEngine)
        loader = SGLangWeightLoader(engine)
        return loader, loader.load_latest_published(paths)

    def build_judge(
        self,
        judge: JudgeConfig,
        model: ModelConfig,
        tokenizer: Any,
        device: torch.device,
        seed: int,
    ) -> JudgeEngine:
        """On the GPUs of the rollout's engine (``device``); SGLang rejects an over-long
        prompt itself (a failed batch), so no length is given."""
        engine = SGLangEngine(
            str(model.path),
            tensor_parallel=judge.engine_tensor_parallel,
            mem_fraction=judge.engine_mem_fraction,
            dtype=serve_dtype(model),
            seed=seed,
            extra_server_args=server_ports(device.index or 0, JUDGE_PORT_OFFSET),
        )
        return engine, None


def build_sglang_engine(cfg: RunConfig, first_gpu: int) -> SGLangEngine:
    if cfg.model.path is None:
        raise ValueError(
            "rollout.backend=sglang needs model.path (a local Hugging Face folder); "
            "built-in models (model.arch) run with rollout.backend=transformers"
        )
    media = MediaProcessor.from_pretrained(cfg.model.path) if is_media_model(cfg.model) else None
    return SGLangEngine(
        cfg.model.path,
        tensor_parallel=cfg.rollout.engine_tensor_parallel,
        mem_fraction=cfg.rollout.engine_mem_fraction,
        dtype=serve_dtype(cfg.model),
        seed=cfg.seed,
        memory_saver=colocated(cfg),  # releases its memory while the trainer trains
        extra_server_args=server_ports(first_gpu),
        media_processor=media,
    )
