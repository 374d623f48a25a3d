"""Wiring of the rollout role: engine, weights, prompts, rewards, spool writer, eval.

Called by ``relax_hpc.component rollout``; returns the process exit code. What each part
does lives in its own module: the engine (``engines/``, built by the ``rollout.backend``
plug-in), the weight policy (``weights.py``), scoring (``scoring.py``), the held-out
evaluation (``evaluation.py``), the loop (``loop.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.config import RunConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.data.sampler import PromptSampler
from relax_hpc.garbage import settle_after_startup
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.assignment import GroupAssignment, WorkerHeartbeat, worker_name
from relax_hpc.rollout.engines.base import Engine, SamplingParams
from relax_hpc.rollout.engines.builder import PolicyEngine, colocated, engine_builder
from relax_hpc.rollout.episodes import EpisodeRollout, build_episode_rollout
from relax_hpc.rollout.evaluation import make_evaluator
from relax_hpc.rollout.loop import RolloutSettings, RolloutWorker
from relax_hpc.rollout.scoring import SampleScorer, close_scorers, make_scorers
from relax_hpc.rollout.weights import EngineWeights, build_receiver
from relax_hpc.runtime import TaskIdentity
from relax_hpc.spool import ShardWriter
from relax_hpc.spool.layout import SpoolLayout
from relax_hpc.weightsync import WeightReceiver


def engine_device(cfg: RunConfig, identity: TaskIdentity) -> torch.device:
    """The first device of this task's engine: task k of a node serves on GPUs k*TP ..."""
    if not cfg.rollout.gpus_per_node:
        return torch.device("cpu")
    return torch.device("cuda", identity.local_rank * cfg.rollout.engine_tensor_parallel)


def build_engine(cfg: RunConfig, device: torch.device) -> PolicyEngine:
    """The engine ``rollout.backend`` names (``engines/registry.py``), its tokenizer and, for
    a model that reads images or audio (``model.modality``), its ``MediaProcessor``."""
    return engine_builder(cfg.rollout.backend).build_policy(cfg, device)


def close_rollout_parts(episodes: EpisodeRollout | None, *scorers: SampleScorer | None) -> None:
    """Stop the tool workers and the reward services (whichever this run has)."""
    if episodes is not None:
        episodes.close()
    close_scorers(*(s for s in scorers if s is not None))


@dataclass
class RolloutParts:
    """What a worker is built from: the engine and what feeds and scores it."""

    engine: Engine
    tokenizer: Any
    processor: MediaProcessor | None
    receiver: WeightReceiver
    weights: EngineWeights
    episodes: EpisodeRollout | None  # an environment's episodes (they score themselves)
    score: SampleScorer | None
    eval_score: SampleScorer | None

    def close_services(self) -> None:
        close_rollout_parts(self.episodes, self.score, self.eval_score)


def stop_condition(paths: RunPaths, identity: TaskIdentity) -> Callable[[], bool]:
    """Stop on a signal, when the trainer is done, or when this worker (or its pool) is
    drained."""
    stop = StopFlag(cancel_request=None).install()
    trainer_done = paths.trainer_done
    name = worker_name(identity.rank, identity.pool)
    drains = [paths.drain_request(n) for n in (name, identity.pool) if n is not None]

    def should_stop() -> bool:
        drained = any(path.exists() for path in drains)
        return stop.local_request() or trainer_done.exists() or drained

    return should_stop


def build_parts(cfg: RunConfig, paths: RunPaths, identity: TaskIdentity) -> RolloutParts:
    """The engine ``rollout.backend`` names, its weight receiver, episodes or scorers."""
    device = engine_device(cfg, identity)
    builder = engine_builder(cfg.rollout.backend)
    engine, tokenizer, processor = builder.build_policy(cfg, device)
    load, loaded_version = builder.weight_loader(engine, paths)
    receiver = build_receiver(cfg, paths, identity, engine, loaded_version)
    weights = EngineWeights(receiver, engine, load)
    # Built before joining: a judge's warm start overlaps the trainer's start-up. With an
    # environment, it rewards the episodes and no scorer is built.
    episodes = build_episode_rollout(cfg, engine, tokenizer, processor)
    score, eval_score = make_scorers(cfg, paths, device) if episodes is None else (None, None)
    return RolloutParts(
        engine, tokenizer, processor, receiver, weights, episodes, score, eval_score
    )


def worker_metrics(paths: RunPaths, identity: TaskIdentity) -> MetricsLogger:
    """TensorBoard and status files of this worker (by rank, or by name in an extra pool)."""
    name = worker_name(identity.rank, identity.pool)
    files = identity.rank if identity.pool is None else name
    return MetricsLogger(paths.rollout_tensorboard_dir(files), paths.rollout_status(files))


def build_assignment(cfg: RunConfig, paths: RunPaths, identity: TaskIdentity) -> GroupAssignment:
    return GroupAssignment(
        paths.rollout_assignment_dir,
        worker_name(identity.rank, identity.pool),
        cfg.rollout.prompts_per_step,
        groups_per_chunk=-(-cfg.rollout.prompts_per_step // identity.world_size),
        lease_s=cfg.rollout.claim_lease_s,
        redo_dir=SpoolLayout(paths.spool_dir).redo_dir,
    )


def start_heartbeat(
    cfg: RunConfig, paths: RunPaths, identity: TaskIdentity, engine: Engine
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        paths.rollout_assignment_dir,
        worker_name(identity.rank, identity.pool),
        interval_s=cfg.rollout.claim_lease_s / 4,
        details=lambda: {"policy_version": engine.policy_version},
    ).start()


def build_worker(
    cfg: RunConfig,
    paths: RunPaths,
    identity: TaskIdentity,
    parts: RolloutParts,
    metrics: MetricsLogger,
    assignment: GroupAssignment,
    should_stop: Callable[[], bool],
) -> RolloutWorker:
    leader = identity.rank == 0 and identity.pool is None  # an extra pool never evaluates
    evaluates = leader and cfg.rollout.eval_interval_steps > 0
    score = parts.score
    return RolloutWorker(
        settings=RolloutSettings(
            prompts_per_step=cfg.rollout.prompts_per_step,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            max_staleness=cfg.max_staleness,
            eval_interval_steps=cfg.rollout.eval_interval_steps,
            seed=cfg.seed,
            colocated=colocated(cfg),
        ),
        engine=parts.engine,
        sampler=PromptSampler(
            build_dataset(cfg.data, parts.tokenizer, split="train", processor=parts.processor),
            seed=cfg.seed,
            shuffle=cfg.data.shuffle,
        ),
        score=score,
        writer=ShardWriter(
            paths.spool_dir,
            f"rollout.{worker_name(identity.rank, identity.pool)}",
            cfg.spool.shard_max_samples,
            on_published=parts.receiver.nudge_trainer,
        ),
        weights=parts.weights,
        params=SamplingParams.from_config(cfg.rollout, cfg.seed),
        metrics=metrics,
        assignment=assignment,
        evaluator=make_evaluator(
            cfg,
            parts.engine,
            parts.tokenizer,
            parts.eval_score,
            metrics,
            paths,
            parts.episodes,
            parts.processor,
        )
        if evaluates
        else None,
        should_stop=should_stop,
        reward_metrics=score.metrics if score is not None else dict,
        episodes=parts.episodes,
    )


def run_rollout(cfg: RunConfig, paths: RunPaths, identity: TaskIdentity) -> int:
    """Build the parts, join the trainer's weight sync, run the loop until told to stop."""
    torch.set_num_threads(cfg.rollout.torch_threads)
    should_stop = stop_condition(paths, identity)
    parts = build_parts(cfg, paths, identity)
    if not parts.weights.join(should_stop):
        parts.close_services()
        return 0
    metrics = worker_metrics(paths, identity)
    assignment = build_assignment(cfg, paths, identity)
    heartbeat = start_heartbeat(cfg, paths, identity, parts.engine)
    worker = build_worker(cfg, paths, identity, parts, metrics, assignment, should_stop)
    settle_after_startup()
    try:
        return worker.run()
    finally:
        heartbeat.stop()
        metrics.close()
        parts.receiver.close()
        parts.close_services()
