"""The rollout loop, readable top to bottom:

    maybe_load_weights -> generate -> score -> write_shard -> log

Worker ``w`` of ``W`` produces, for every training step, its share of that step's
prompts: groups ``g`` with ``g % W == w`` among ``[k * P, (k + 1) * P)`` for batch ``k``
(``P`` prompts per step). Batch ``k`` is consumed by training step ``k + 1``, so it may be
generated with any policy version ``>= k - max_staleness`` (0 in sync/hybrid mode: exactly
on-policy). Group ``g`` draws prompt ``g`` of the seeded, epoch-shuffled prompt stream and
its samples are ``g/<j>``: a rerun after a crash regenerates identical samples, and the
spool never delivers a sample id twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from relax_hpc.data.sampler import PromptSampler
from relax_hpc.observe.metrics import MetricsLogger, PhaseTimer
from relax_hpc.paths import atomic_write_json, read_json
from relax_hpc.rollout.engines.base import Completion, Engine, GenerationRequest, SamplingParams
from relax_hpc.spool import Sample, ShardWriter

log = logging.getLogger(__name__)


@dataclass
class RolloutSettings:
    worker: int
    num_workers: int
    prompts_per_step: int
    n_samples_per_prompt: int
    max_staleness: int
    eval_interval_steps: int
    seed: int
    colocated: bool = False  # sync mode: hand the devices to the trainer between batches


class RolloutWorker:
    def __init__(
        self,
        settings: RolloutSettings,
        engine: Engine,
        sampler: PromptSampler,
        score: Callable[[list[tuple[Completion, object]]], list[tuple[float, dict]]],
        writer: ShardWriter,
        weights,  # .wait_for(min_version, should_stop) -> bool; .refresh()
        params: SamplingParams,
        metrics: MetricsLogger,
        progress_path,
        evaluator=None,  # callable(policy_version) -> dict of eval metrics, or None
        should_stop: Callable[[], bool] = lambda: False,
        # per-part reward figures and reward services' totals (rewards/compose.py)
        reward_metrics: Callable[[], Mapping[str, float]] = dict,
    ) -> None:
        self.s = settings
        self.engine = engine
        self.sampler = sampler
        self.score = score
        self.writer = writer
        self.weights = weights
        self.params = params
        self.metrics = metrics
        self.progress_path = progress_path
        self.evaluator = evaluator
        self.should_stop = should_stop
        self.reward_metrics = reward_metrics
        self.timer = PhaseTimer()
        self.batch_index = self._load_progress()
        self.last_eval_version = -1

    def run(self) -> int:
        while not self.should_stop():
            with self.timer.phase("wait_for_weights"):
                if not self.maybe_load_weights():
                    break
            self.maybe_eval()
            with self.timer.phase("generate"):
                groups = self.generate()
            with self.timer.phase("write_shard"):
                self.write_shard(groups)
            if self.s.colocated:
                self.engine.release_memory()  # the trainer trains on these devices next
            self.log(groups)
        self.maybe_eval(final=True)
        return 0

    # --- the phases ----------------------------------------------------------------------------
    def maybe_load_weights(self) -> bool:
        """Wait until the engine's policy is recent enough for the next batch."""
        needed = max(self.batch_index - self.s.max_staleness, 0)
        return self.weights.wait_for(needed, self.should_stop)

    def group_ids(self) -> list[int]:
        start = self.batch_index * self.s.prompts_per_step
        stop = start + self.s.prompts_per_step
        return [g for g in range(start, stop) if g % self.s.num_workers == self.s.worker]

    def generate(self) -> list[list[Sample]]:
        if self.s.colocated:
            self.engine.resume_memory()
        prompts = [(g, self._prompt(g)) for g in self.group_ids()]
        requests = [
            GenerationRequest(f"{g}/{j}", record.prompt_ids)
            for g, (_, record) in prompts
            for j in range(self.s.n_samples_per_prompt)
        ]
        completions = self.engine.generate(requests, self.params)
        n = self.s.n_samples_per_prompt
        records = [record for _, (_, record) in prompts for _ in range(n)]
        with self.timer.phase("score"):
            scores = self.score(list(zip(completions, records, strict=True)))
        samples = iter(zip(completions, scores, strict=True))
        return [
            [self._sample(g, data_index, *next(samples)) for _ in range(n)]
            for g, (data_index, _) in prompts
        ]

    def write_shard(self, groups: list[list[Sample]]) -> None:
        if groups:
            self.writer.publish(groups)
        self.batch_index += 1
        atomic_write_json(
            self.progress_path, {"batch_index": self.batch_index, "time": time.time()}
        )

    def log(self, groups: list[list[Sample]]) -> None:
        samples = [s for g in groups for s in g]
        rewards = np.array([s.reward for s in samples]) if samples else np.zeros(1)
        lengths = np.array([len(s.response_token_ids) for s in samples]) if samples else np.zeros(1)
        metrics = self.timer.pop()
        seconds = metrics.get("time/generate_s", 0.0)
        metrics.update(
            {
                "rollout/reward_mean": float(rewards.mean()),
                "rollout/response_length_mean": float(lengths.mean()),
                "rollout/policy_version": float(self.engine.policy_version),
                "throughput/samples_per_s": len(samples) / seconds if seconds else 0.0,
                "throughput/tokens_per_s": float(lengths.sum()) / seconds if seconds else 0.0,
                **self.reward_metrics(),
            }
        )
        self.metrics.log(
            self.batch_index, metrics, extra={"policy_version": self.engine.policy_version}
        )

    def maybe_eval(self, final: bool = False) -> None:
        version = self.engine.policy_version
        interval = self.s.eval_interval_steps
        due = interval and (version % interval == 0 or final)
        if self.evaluator is None or not due or version == self.last_eval_version:
            return
        self.last_eval_version = version
        with self.timer.phase("eval"):
            self.evaluator(version)

    # --- helpers -------------------------------------------------------------------------------
    def _prompt(self, group_index: int):
        size = len(self.sampler.dataset)
        state = self.sampler.state_dict()
        state.update(epoch=group_index // size, position=group_index % size)
        self.sampler.load_state_dict(state)
        return next(self.sampler)

    def _sample(
        self, g: int, data_index: int, completion: Completion, scored: tuple[float, dict]
    ) -> Sample:
        reward, details = scored
        response = np.asarray(completion.token_ids, dtype=np.int32)
        return Sample(
            sample_id=completion.sample_id,
            group_id=str(g),
            data_index=int(data_index),
            prompt_token_ids=np.asarray(completion.prompt_ids, dtype=np.int32),
            response_token_ids=response,
            loss_mask=np.ones(len(response), dtype=np.uint8),
            rollout_logprobs=np.asarray(completion.logprobs, dtype=np.float32),
            reward=float(reward),
            policy_version=int(completion.policy_version),
            finish_reason=completion.finish_reason,
            reward_details=details,
        )

    def _load_progress(self) -> int:
        try:
            return int(read_json(self.progress_path)["batch_index"])
        except (FileNotFoundError, ValueError, KeyError):
            return 0
