"""The engine plug-in interface: how an engine kind is built and fed the trainer's weights.

``rollout.backend`` (and ``judge.backend``) name an ``EngineBuilder`` in
``registry.ENGINES``; the rollout calls ``build_policy`` once per worker, then
``weight_loader`` for the receiver's ``load_fn``. ``build_judge`` is optional: a builder
without one cannot serve ``judge.backend``.

Must not: import an engine's library at module level (a builder imports its engine when
it builds one).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from relax_hpc.config import RunConfig
from relax_hpc.config.schema import JudgeConfig, ModelConfig
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.base import Engine
from relax_hpc.rollout.engines.registry import ENGINES, JUDGE_ENGINES
from relax_hpc.weightsync.receiver import LoadFn

# (engine, tokenizer, the MediaProcessor of a model that reads images/audio or None)
PolicyEngine = tuple[Engine, Any, Any]
# (engine, the longest prompt + completion it takes in tokens, or None: it refuses longer)
JudgeEngine = tuple[Engine, int | None]


class EngineBuilder(abc.ABC):
    """One engine kind. Stateless: the rollout builds it with no arguments."""

    @abc.abstractmethod
    def build_policy(self, cfg: RunConfig, device: torch.device) -> PolicyEngine:
        """The policy's engine on ``device`` (the first of its GPUs, or the CPU)."""

    def weight_loader(self, engine: Engine, paths: RunPaths) -> tuple[LoadFn, int | None]:
        """The receiver's ``load_fn`` for ``engine``, and the verified version it already
        holds (None: every version comes through the receiver). By default the receiver
        copies each version in with ``Engine.load_state_dict``; the version it carries is
        set by the rollout once the load is verified."""
        return lambda tensors: engine.load_state_dict(tensors, engine.policy_version), None

    def build_judge(
        self,
        judge: JudgeConfig,
        model: ModelConfig,
        tokenizer: Any,
        device: torch.device,
        seed: int,
    ) -> JudgeEngine:
        """A frozen engine for the judge's ``model`` on the rollout engine's ``device``."""
        raise ValueError(
            f"judge.backend: {judge.backend} cannot serve a judge (its builder has no "
            "build_judge); use judge.backend=transformers or sglang"
        )


def colocated(cfg: RunConfig) -> bool:
    """``mode=sync``: the roles time-share devices, so the engine releases its memory
    between batches (``RolloutWorker``) and takes it back before it generates."""
    return cfg.mode == "sync"


def engine_builder(spec: str) -> EngineBuilder:
    """The builder ``rollout.backend`` names (a built-in or ``package.module:Builder``)."""
    return ENGINES.load(spec)()


def judge_engine_builder(spec: str) -> EngineBuilder:
    """The builder ``judge.backend`` names."""
    return JUDGE_ENGINES.load(spec)()
