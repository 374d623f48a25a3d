"""Wiring of the rollout role: engine, weights, prompts, rewards, spool writer, eval.

Called by ``relax_hpc.component rollout``; returns the process exit code.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.config import RunConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.data.sampler import PromptSampler
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths, atomic_write_json
from relax_hpc.rollout.assignment import GroupAssignment, WorkerHeartbeat, worker_name
from relax_hpc.rollout.engines.base import Engine, GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.builder import PolicyEngine, colocated, engine_builder
from relax_hpc.rollout.engines.media_engine import media_request
from relax_hpc.rollout.episodes import EpisodeRollout, build_episode_rollout
from relax_hpc.rollout.loop import RolloutSettings, RolloutWorker
from relax_hpc.rollout.rewards.compose import CompositeScorer
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_scorer
from relax_hpc.rollout.sglang_weights import SGLangDistributedTarget
from relax_hpc.runtime import TaskIdentity
from relax_hpc.spool import ShardWriter
from relax_hpc.spool.layout import SpoolLayout
from relax_hpc.weightsync import (
    PerTensorReceiver,
    WeightReceiver,
    WeightSyncError,
)
from relax_hpc.weightsync.receiver import LoadFn

log = logging.getLogger(__name__)
POLL_S = 0.5


class EngineWeights:
    """Keeps the engine's weights current; fail-closed: no generation without verified weights."""

    def __init__(self, receiver: WeightReceiver, engine: Engine, load: LoadFn) -> None:
        self.receiver = receiver
        self.engine = engine
        self.load = load

    def _behind(self, min_version: int) -> bool:
        current = self.receiver.current_policy_version
        return current is None or current < min_version

    def join(self, should_stop) -> bool:
        """Join the trainer's weight sync; retried while the trainer is (re)starting.

        A requeued job may still show the previous trainer's rendezvous file for a moment,
        and a first run's trainer may take a while to build its model.
        """
        while not should_stop():
            try:
                self.receiver.join(self.load)
            except (WeightSyncError, OSError, RuntimeError) as err:
                log.info("rollout: trainer not reachable yet (%s); retrying", err)
                time.sleep(POLL_S)
                continue
            if self.receiver.current_policy_version is not None:
                self.engine.policy_version = self.receiver.current_policy_version
            return True
        return False

    def wait_for(self, min_version: int, should_stop) -> bool:
        """Take newer weights if a round is open now; block only while behind ``min_version``.

        An async rollout that may generate with the weights it has does not wait for the
        trainer's next round: it generates while the trainer trains (the overlap), and the
        trainer's call waits for it (``weightsync.busy_timeout_s``).
        """
        while True:
            may_generate = self.receiver.ready_to_generate and not self._behind(min_version)
            # A trainer that died and restarts is waited for and rejoined by the receiver:
            # this process keeps its engine and weights (a wrong token raises).
            update = self.receiver.poll_for_update(
                self.load, wait_s=0.0 if may_generate else POLL_S
            )
            if update is None and self._behind(min_version):
                # Not admitted yet (the trainer admits at its next sync, which may need this
                # very batch): the trainer's filesystem export breaks that circle.
                update = self.receiver.load_latest_from_filesystem(self.load)
            if update is not None:
                self.engine.policy_version = update.policy_version
                log.info(
                    "rollout: loaded policy_version %d (%s)", update.policy_version, update.source
                )
            current = self.receiver.current_policy_version
            if self.receiver.ready_to_generate and current is not None and current >= min_version:
                return True
            if should_stop():
                return False


def engine_device(cfg: RunConfig, identity: TaskIdentity) -> torch.device:
    """The first device of this task's engine: task k of a node serves on GPUs k*TP ..."""
    if not cfg.rollout.gpus_per_node:
        return torch.device("cpu")
    return torch.device("cuda", identity.local_rank * cfg.rollout.engine_tensor_parallel)


def build_engine(cfg: RunConfig, device: torch.device) -> PolicyEngine:
    """The engine ``rollout.backend`` names (``engines/registry.py``), its tokenizer and, for
    a model that reads images or audio (``model.modality``), its ``MediaProcessor``."""
    return engine_builder(cfg.rollout.backend).build_policy(cfg, device)


def build_receiver(
    cfg: RunConfig, paths: RunPaths, identity: TaskIdentity, engine: Engine, loaded: int | None
) -> WeightReceiver:
    """Buckets through this process (any engine), or straight into SGLang's update group."""
    engine_id = f"rollout-{identity.rank}"
    # The run's own workers wait for the trainer of their job start; an extra pool serves
    # whichever start is running (a stale endpoint refuses the connection: it retries).
    attempt = identity.attempt
    if identity.pool is not None:
        engine_id, attempt = f"rollout-{worker_name(identity.rank, identity.pool)}", ""
    if cfg.weightsync.transport == "sglang_distributed":
        return PerTensorReceiver(
            paths,
            engine_id,
            cfg.weightsync,
            SGLangDistributedTarget(engine),
            initial_policy_version=loaded,
            attempt=attempt,
        )
    return WeightReceiver(
        paths, engine_id, cfg.weightsync, initial_policy_version=loaded, attempt=attempt
    )


class SampleScorer:
    """Scores a batch of (completion, record) pairs with ``rollout.reward``'s parts."""

    def __init__(self, scorer: CompositeScorer) -> None:
        self.scorer = scorer

    def __call__(self, pairs) -> list[tuple[float, dict]]:
        items = [ScoreItem(c.text, r.answer, r.metadata, r.prompt) for c, r in pairs]
        scored = []
        for result in self.scorer.score(items):
            details = dict(result.details)
            if result.failed:  # Sample.reward_failed: trained with no loss weight
                details["failed"] = result.failed
                details["reward_failed"] = True
            scored.append((result.score, details))
        return scored

    def metrics(self) -> dict[str, float]:
        return self.scorer.metrics()

    def close(self) -> None:
        self.scorer.close()


def make_scorer(
    cfg: RunConfig, paths: RunPaths, device: torch.device, reward: str | None = None
) -> SampleScorer:
    """``reward`` (default ``rollout.reward``) with the judge, reward models and endpoints it
    names, on this worker's device (``rollout/rewards/services.py``)."""
    rewards = cfg.rewards
    if reward is not None:  # the held-out eval's own reward: no monitors
        rewards = dataclasses.replace(rewards, agreement_with=None)
    context = RewardContext(
        paths=paths,
        device=device,
        data=cfg.data,
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        seed=cfg.seed,
    )
    return SampleScorer(build_scorer(reward or cfg.rollout.reward, rewards, cfg.judge, context))


def make_scorers(
    cfg: RunConfig, paths: RunPaths, device: torch.device
) -> tuple[SampleScorer, SampleScorer]:
    """The training scorer and the held-out eval's (the same one unless
    ``rewards.eval_reward`` names another reward)."""
    score = make_scorer(cfg, paths, device)
    eval_reward = cfg.rewards.eval_reward
    own_eval = eval_reward not in (None, cfg.rollout.reward)
    return score, make_scorer(cfg, paths, device, eval_reward) if own_eval else score


def close_scorers(*scorers: SampleScorer) -> None:
    for scorer in {id(s): s for s in scorers}.values():
        scorer.close()


def close_rollout_parts(episodes: EpisodeRollout | None, *scorers: SampleScorer | None) -> None:
    """Stop the tool workers and the reward services (whichever this run has)."""
    if episodes is not None:
        episodes.close()
    close_scorers(*(s for s in scorers if s is not None))


def make_evaluator(
    cfg: RunConfig,
    engine,
    tokenizer,
    score,
    metrics: MetricsLogger,
    paths: RunPaths,
    episodes: EpisodeRollout | None = None,
    processor: MediaProcessor | None = None,
):
    """Greedy held-out eval: single completions scored by ``score``, or whole episodes."""
    dataset = build_dataset(cfg.data, tokenizer, split="eval", processor=processor)
    # Rows skipped for their media (logged by the dataset) are left out and counted.
    read = [dataset[i] for i in range(min(len(dataset), cfg.data.eval_size))]
    records = [r for r in read if r is not None]
    skipped = {"data/eval_rows_skipped": float(len(read) - len(records))}
    params = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop), greedy=True
    )
    history: list[dict] = []

    def measure() -> dict[str, float]:
        if episodes is not None:
            return episodes.evaluate(records, params)
        requests = [
            GenerationRequest(
                f"eval/{i}", r.prompt_ids, media_request(r.media) if r.media is not None else None
            )
            for i, r in enumerate(records)
        ]
        completions = engine.generate(requests, params)
        scores = score(list(zip(completions, records, strict=True)))
        return {"eval/accuracy": sum(value > 0.5 for value, _ in scores) / max(len(records), 1)}

    def evaluate(policy_version: int) -> dict[str, float]:
        results = {**measure(), **skipped}
        accuracy = results["eval/accuracy"]
        history.append(
            {"policy_version": policy_version, "accuracy": accuracy, "time": time.time()}
        )
        if metrics.writer is not None:
            for name, value in results.items():
                metrics.writer.add_scalar(name, value, global_step=policy_version)
            metrics.writer.flush()
        atomic_write_json(paths.eval_history, {"history": history})
        log.info("eval: policy_version %d held-out greedy accuracy %.3f", policy_version, accuracy)
        return results

    return evaluate


def run_rollout(cfg: RunConfig, paths: RunPaths, identity: TaskIdentity) -> int:
    torch.set_num_threads(cfg.rollout.torch_threads)
    device = engine_device(cfg, identity)
    stop = StopFlag(cancel_request=None).install()
    trainer_done = paths.trainer_done
    name = worker_name(identity.rank, identity.pool)
    drains = [paths.drain_request(n) for n in (name, identity.pool) if n is not None]

    def should_stop() -> bool:
        drained = any(path.exists() for path in drains)
        return stop.local_request() or trainer_done.exists() or drained

    builder = engine_builder(cfg.rollout.backend)
    engine, tokenizer, processor = builder.build_policy(cfg, device)
    load, loaded_version = builder.weight_loader(engine, paths)
    receiver = build_receiver(cfg, paths, identity, engine, loaded_version)
    weights = EngineWeights(receiver, engine, load)
    # Built before joining: a judge's warm start overlaps the trainer's start-up. With an
    # environment, it rewards the episodes and no scorer is built.
    episodes = build_episode_rollout(cfg, engine, tokenizer, processor)
    score, eval_score = make_scorers(cfg, paths, device) if episodes is None else (None, None)
    if not weights.join(should_stop):
        close_rollout_parts(episodes, score, eval_score)
        return 0
    leader = identity.rank == 0 and identity.pool is None  # an extra pool never evaluates
    files = identity.rank if identity.pool is None else name
    metrics = MetricsLogger(paths.rollout_tensorboard_dir(files), paths.rollout_status(files))
    assignment = GroupAssignment(
        paths.rollout_assignment_dir,
        name,
        cfg.rollout.prompts_per_step,
        groups_per_chunk=-(-cfg.rollout.prompts_per_step // identity.world_size),
        lease_s=cfg.rollout.claim_lease_s,
        redo_dir=SpoolLayout(paths.spool_dir).redo_dir,
    )
    heartbeat = WorkerHeartbeat(
        paths.rollout_assignment_dir,
        name,
        interval_s=cfg.rollout.claim_lease_s / 4,
        details=lambda: {"policy_version": engine.policy_version},
    ).start()
    worker = RolloutWorker(
        settings=RolloutSettings(
            prompts_per_step=cfg.rollout.prompts_per_step,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            max_staleness=cfg.max_staleness,
            eval_interval_steps=cfg.rollout.eval_interval_steps,
            seed=cfg.seed,
            colocated=colocated(cfg),
        ),
        engine=engine,
        sampler=PromptSampler(
            build_dataset(cfg.data, tokenizer, split="train", processor=processor),
            seed=cfg.seed,
            shuffle=cfg.data.shuffle,
        ),
        score=score,
        writer=ShardWriter(
            paths.spool_dir,
            f"rollout.{name}",
            cfg.spool.shard_max_samples,
            on_published=receiver.nudge_trainer,
        ),
        weights=weights,
        params=SamplingParams.from_config(cfg.rollout, cfg.seed),
        metrics=metrics,
        assignment=assignment,
        evaluator=make_evaluator(
            cfg, engine, tokenizer, eval_score, metrics, paths, episodes, processor
        )
        if leader and cfg.rollout.eval_interval_steps > 0
        else None,
        should_stop=should_stop,
        reward_metrics=score.metrics if score is not None else dict,
        episodes=episodes,
    )
    try:
        return worker.run()
    finally:
        heartbeat.stop()
        metrics.close()
        receiver.close()
        close_rollout_parts(episodes, score, eval_score)
