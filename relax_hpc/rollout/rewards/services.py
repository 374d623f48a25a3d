"""From configuration to scorers: every reward part a run names, built where it runs.

``build_scorer`` turns ``rollout.reward`` (one part, or ``composite``), ``rewards`` and
``judge`` into one ``CompositeScorer``: rule rewards in their child process
(``scorer.RewardScorer``), the judge on the rollout's engines (``judge.JudgeScorer``) or in
its own component (``remote.RemoteScorer`` over ``JudgeTargets``), reward models
(``reward_model``), endpoints (``remote.RemoteScorer`` over ``EndpointTargets``).
``build_judge_scorer`` is also what the judge's own component serves.

Heavy imports (torch, transformers, the engines) happen inside the builders that need them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.config.rewards import COMPOSITE, RewardsConfig
from relax_hpc.config.schema import DataConfig, JudgeConfig, ModelConfig
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.rollout.rewards.compose import CompositeScorer, Weights
from relax_hpc.rollout.rewards.registry import ENDPOINT, JUDGE, REWARD_MODEL, part_kind
from relax_hpc.rollout.rewards.result import BatchScorer
from relax_hpc.rollout.rewards.scorer import RewardScorer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RewardContext:
    """Where the scorers run: the run directory, the device, what a warm start needs."""

    paths: RunPaths | None = None
    device: Any = "cpu"  # torch.device or its name: the rollout engine's device
    data: DataConfig | None = None  # the task a judge warm start trains on
    reward_timeout_s: float | None = 10.0  # rule rewards' per-sample timeout
    seed: int = 0
    cache_dir: Path | None = None  # warm starts (default: paths.default_cache_dir)


def build_scorer(
    reward: str, rewards: RewardsConfig, judge: JudgeConfig | None, context: RewardContext
) -> CompositeScorer:
    """``rollout.reward`` as a scorer with every part it needs (and the monitors)."""
    if reward == COMPOSITE:
        weights = Weights(
            {k: float(v) for k, v in rewards.weights.items()},
            {s: {k: float(v) for k, v in t.items()} for s, t in rewards.weights_by_source.items()},
            rewards.source_key,
        )
    else:
        weights = Weights({reward: 1.0})
    names = [*weights.default, *(p for table in weights.by_source.values() for p in table)]
    if rewards.agreement_with:
        names.append(rewards.agreement_with)
    parts: dict[str, BatchScorer] = {}
    try:
        for name in dict.fromkeys(names):
            parts[name] = build_part(name, rewards, judge, context)
    except BaseException:
        for part in parts.values():
            part.close()
        raise
    return CompositeScorer(parts, weights, rewards.agreement_with)


def build_part(
    name: str, rewards: RewardsConfig, judge: JudgeConfig | None, context: RewardContext
) -> BatchScorer:
    kind = part_kind(name, rewards, judge is not None, "rollout.reward")
    if kind == JUDGE:
        assert judge is not None
        return build_judge_scorer(judge, context)
    if kind == REWARD_MODEL:
        return build_reward_model_scorer(name, rewards, context)
    if kind == ENDPOINT:
        return build_endpoint_scorer(name, rewards, context)
    return RewardScorer(name, context.reward_timeout_s)


def build_endpoint_scorer(name: str, rewards: RewardsConfig, context: RewardContext):
    from relax_hpc.rollout.rewards.credentials import endpoint_token
    from relax_hpc.rollout.rewards.remote import EndpointTargets, RemoteScorer

    endpoint = rewards.endpoints[name]
    token = endpoint_token(name, endpoint, context.paths)
    return RemoteScorer(name, EndpointTargets(endpoint.url, token), endpoint, seed=context.seed)


def build_reward_model_scorer(name: str, rewards: RewardsConfig, context: RewardContext):
    from relax_hpc.models.build import resolve_dtype
    from relax_hpc.rollout.rewards.reward_model import RewardModelScorer

    rm = rewards.reward_models[name]
    model, tokenizer = reward_model_and_tokenizer(
        name, rewards, context, resolve_dtype(rm.dtype, context.device)
    )
    return RewardModelScorer(
        model.to(context.device),
        tokenizer,
        rm.template,
        rm.label,
        rm.normalize,
        rm.batch_size,
        rm.max_length,
    )


def reward_model_and_tokenizer(name: str, rewards: RewardsConfig, context: RewardContext, dtype):
    """From ``path``, from its cached warm start, or built from ``arch`` (weights from the
    run's seed: a miniature's reward model, whose scores are noise)."""
    from relax_hpc.models.build import build_from_arch, build_tokenizer
    from relax_hpc.rollout.rewards.reward_model import load_reward_model

    rm = rewards.reward_models[name]
    field = f"rewards.reward_models.{name}.path"
    if rm.path is not None:
        return load_reward_model(rm.path, field, rm.label, dtype)
    model_cfg = ModelConfig(
        name=name, architecture=rm.architecture, arch=rm.arch, tokenizer=rm.tokenizer
    )
    if rm.warm_start != "none":
        field_name = f"rewards.reward_models.{name}.warm_start"
        folder = warm_started_folder(
            rm.warm_start, field_name, "reward_model", f"reward model {name}", model_cfg, context
        )
        return load_reward_model(str(folder), field, rm.label, dtype)
    tokenizer = build_tokenizer(model_cfg)
    return build_from_arch(model_cfg, tokenizer, dtype, seed=context.seed), tokenizer


def warm_started_folder(
    name: str, field: str, trains: str, who: str, model_cfg: ModelConfig, context: RewardContext
) -> Path:
    """The cached warm start of task ``name`` (named by ``field``; it must train a
    ``trains`` model) for ``who``, trained the first time; its measured quality logged."""
    from relax_hpc.paths import default_cache_dir
    from relax_hpc.tasks.registry import task
    from relax_hpc.tasks.warm_start import METADATA_NAME

    if context.data is None:
        raise ValueError(f"{field}={name} needs the run's data config (the task it trains on)")
    chosen = task(name, field)
    if chosen.warm_starts != trains:
        raise ValueError(f"{field}: {name} warm-starts a {chosen.warm_starts}, not a {trains}")
    folder = chosen.warm_start(model_cfg, context.data, context.cache_dir or default_cache_dir())
    quality = chosen.quality(read_json(folder / METADATA_NAME))
    log.info("%s: %s from %s %s", who, name, folder, quality)
    return folder


def build_judge_scorer(judge: JudgeConfig, context: RewardContext) -> BatchScorer:
    """The judge: its engine here (``placement=rollout``, or in the judge's own component),
    or a client of the judge's component (``placement=component``, called by the rollout)."""
    if judge.placement == "component" and context.paths is not None:
        from relax_hpc.rollout.rewards.remote import JudgeTargets, RemoteScorer

        return RemoteScorer(JUDGE, JudgeTargets(context.paths), judge.client, seed=context.seed)
    return build_judge_engine_scorer(judge, context)


def judge_model_config(judge: JudgeConfig, context: RewardContext) -> ModelConfig:
    """The judge's model as configured, or the cached warm start of its task."""
    if judge.warm_start == "none":
        return judge.model
    from relax_hpc.tasks.warm_start import warm_started_model_config

    folder = warm_started_folder(
        judge.warm_start, "judge.warm_start", "judge", "judge", judge.model, context
    )
    return warm_started_model_config(judge.model, folder)


def build_judge_engine_scorer(judge: JudgeConfig, context: RewardContext):
    """The judge's engine (``judge.backend``, an engine of ``engines/registry.py``) here."""
    import torch

    from relax_hpc.models.build import build_tokenizer
    from relax_hpc.rollout.engines.builder import judge_engine_builder
    from relax_hpc.rollout.rewards.judge import JudgeScorer
    from relax_hpc.rollout.rewards.verdicts import build_verdict, template_text

    model_cfg = judge_model_config(judge, context)
    tokenizer = build_tokenizer(model_cfg)
    builder = judge_engine_builder(judge.backend)
    engine, max_positions = builder.build_judge(
        judge, model_cfg, tokenizer, torch.device(context.device), context.seed
    )
    return JudgeScorer(
        engine,
        tokenizer,
        template_text(judge.template),
        build_verdict(judge.verdict, judge.score_range, judge.letter_scores),
        max_new_tokens=judge.max_new_tokens,
        batch_size=judge.batch_size,
        apply_chat_template=judge.apply_chat_template,
        max_prompt_tokens=max_positions - judge.max_new_tokens if max_positions else None,
    )
