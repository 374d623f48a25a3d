"""The multi-turn path of the rollout loop: groups of prompts in, whole trajectories out.

With ``rollout.environment`` set, ``RolloutWorker.generate`` hands its batch here instead of
one engine call. Every sample of every group is one episode (``rollout.multiturn``), all of
them in flight at once; sample ``j`` of group ``g`` is still ``g/<j>`` (its later turns are
engine requests ``g/<j>#t<k>``), so a rerun after a crash replays the same episodes and the
spool's exactly-once accounting is unchanged. The batch is returned only when every episode
has ended, and the loop publishes it as one shard: a trajectory is in the spool whole or
not at all. The environment's step rewards are the reward (no scorer runs).

``EpisodeRollout`` owns what lives as long as the worker: the episode runner (its step
threads) and the tool sandbox (its worker processes); ``close()`` both at exit.

Images: a prompt's media (``PromptRecord.media``) start every episode of its group, and a
vision model's runner (built with the engine's ``MediaProcessor``) lets observations add
images (``Observation.images``): every turn's request carries all images so far, and the
sample's ``media`` holds them in order (``rollout.multiturn``).

Must not: score outside the environment, write the spool, or import the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from relax_hpc.config import RunConfig
from relax_hpc.data.datasets import PromptRecord
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.rollout.engines.base import Engine, SamplingParams
from relax_hpc.rollout.envs import EnvRuntime, resolve_environment
from relax_hpc.rollout.multiturn import EpisodeBudget, EpisodeRequest, EpisodeRunner
from relax_hpc.rollout.tools.sandbox import ToolSandbox
from relax_hpc.rollout.trajectory import Trajectory, episode_metrics, to_sample
from relax_hpc.spool import Sample
from relax_hpc.spool.redo import redo_sample_id

log = logging.getLogger(__name__)

# (group index, (data index, record)): what RolloutWorker draws for one batch
Prompts = Sequence[tuple[int, tuple[int, PromptRecord]]]


def environment_row(record: PromptRecord) -> dict[str, Any]:
    """The row an environment's ``reset`` sees: its columns, the prompt as the data holds
    it (a string or chat messages) and the reference answer."""
    prompt = record.prompt if record.source_prompt is None else record.source_prompt
    return {**record.metadata, "prompt": prompt, "answer": record.answer}


class EpisodeRollout:
    """Batches of groups as episodes; ``close()`` when the worker ends."""

    def __init__(self, runner: EpisodeRunner, sandbox: ToolSandbox | None = None) -> None:
        self.runner = runner
        self.sandbox = sandbox
        self._last: list[Trajectory] = []

    def generate(
        self, prompts: Prompts, n: int, params: SamplingParams, attempt: int = 0
    ) -> list[list[Sample]]:
        """``n`` trajectories per group, as spool samples, in group order (``attempt``:
        a redo's, which gives its samples their own ids)."""
        requests = [
            EpisodeRequest(
                redo_sample_id(g, j, attempt),
                record.prompt_ids,
                environment_row(record),
                record.media,
            )
            for g, (_, record) in prompts
            for j in range(n)
        ]
        trajectories = self.runner.run(requests, params)
        self._last = trajectories
        ended = iter(trajectories)
        return [
            [to_sample(next(ended), str(g), int(data_index)) for _ in range(n)]
            for g, (data_index, _) in prompts
        ]

    def metrics(self) -> dict[str, float]:
        """``agent/*`` figures of the last batch (turns, tool calls and errors, ...)."""
        return episode_metrics(self._last) if self._last else {}

    def evaluate(self, records: Sequence[PromptRecord], params: SamplingParams) -> dict:
        """One episode per record: the share rewarded > 0.5 (``eval/accuracy``, as for
        single-turn runs), the mean reward, the share that called a tool, turns."""
        requests = [
            EpisodeRequest(f"eval/{i}", r.prompt_ids, environment_row(r), r.media)
            for i, r in enumerate(records)
        ]
        trajectories = self.runner.run(requests, params)
        count = max(len(trajectories), 1)
        return {
            "eval/accuracy": sum(t.reward > 0.5 for t in trajectories) / count,
            "eval/reward_mean": sum(t.reward for t in trajectories) / count,
            "eval/tool_call_rate": sum(t.num_tool_calls > 0 for t in trajectories) / count,
            "eval/turns_mean": sum(t.num_turns for t in trajectories) / count,
        }

    def close(self) -> None:
        self.runner.close()
        if self.sandbox is not None:
            self.sandbox.close()


def build_episode_rollout(
    cfg: RunConfig, engine: Engine, tokenizer, processor: MediaProcessor | None = None
) -> EpisodeRollout | None:
    """The episode path of ``cfg`` (None: ``rollout.environment`` is null, single-turn);
    ``processor``: a vision model's, so observations may carry images."""
    rollout = cfg.rollout
    if rollout.environment is None:
        return None
    env_class = resolve_environment(rollout.environment, rollout.environment_options)
    sandbox = None
    if getattr(env_class, "uses_tools", False):
        tools = rollout.tools
        sandbox = ToolSandbox(
            num_workers=tools.num_workers,
            timeout_s=tools.timeout_s,
            max_output_bytes=tools.max_output_bytes,
            memory_mb=tools.memory_mb or None,
        )
    budget = EpisodeBudget(rollout.max_turns, rollout.max_episode_tokens, rollout.episode_timeout_s)
    runner = EpisodeRunner(
        engine,
        ChatFormat(tokenizer),
        env_class,
        EnvRuntime(sandbox, dict(rollout.environment_options)),
        budget,
        seed=cfg.seed,
        media_processor=processor,
    )
    log.info(
        "rollout: episodes of %s (%s), up to %d turns / %d tokens / %g s each",
        rollout.environment,
        env_class.__name__,
        budget.max_turns,
        budget.max_response_tokens,
        budget.max_wall_s,
    )
    return EpisodeRollout(runner, sandbox)
