"""The held-out evaluation: greedy completions (or whole episodes) on the eval split, scored,
written to TensorBoard and ``status/eval.json`` (``RunPaths.eval_history``).

Must not: train, or write shards.
"""

from __future__ import annotations

import logging
import time

from relax_hpc.config import RunConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths, atomic_write_json
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import media_request
from relax_hpc.rollout.episodes import EpisodeRollout

log = logging.getLogger(__name__)


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
        metrics.add_scalars(policy_version, results)
        metrics.flush()
        atomic_write_json(paths.eval_history, {"history": history})
        log.info("eval: policy_version %d held-out greedy accuracy %.3f", policy_version, accuracy)
        return results

    return evaluate
