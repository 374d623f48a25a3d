"""One multi-turn episode as one training sample: tokens, loss mask, turns, tool accounting.

Layout of ``response_ids`` (everything after the prompt), turn by turn::

    [model tokens of turn 0][observation 0][model tokens of turn 1][observation 1]...[turn n]

``loss_mask`` is 1 on model tokens and 0 on observation tokens; ``rollout_logprobs`` holds the
engine's log-probs on model tokens and 0.0 on observation tokens (placeholders: the mask
removes them from every loss and count). ``Turn.start`` is the offset of the turn's first
model token in ``response_ids``. The last turn has no observation (the episode ended).

``to_sample`` maps a trajectory onto the spool's ``Sample`` (schema 1 already carries it):
``finish_reason`` = the end reason, ``num_turns``, ``policy_version`` = the oldest turn's,
and in ``metadata``: ``turns`` ([start, model tokens, observation tokens] per turn),
``tool_calls``, ``tool_status`` (calls per status other than ok), ``observation_tokens``,
plus the environment's info under ``env``. A reward the environment could not compute
(``info["reward_failed"]``) sets ``reward_details["reward_failed"]`` (``Sample.reward_failed``).

``episode_metrics`` summarises a batch of trajectories for TensorBoard and the progress line.

Must not: import torch, the engines or the trainer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.media.payload import MediaPayload
from relax_hpc.spool import Sample

# Why an episode ended: the environment said so, or a budget ran out, or the environment
# raised (its message is in ``info["env_error"]``).
END_REASONS = ("done", "max_turns", "max_tokens", "wall_time", "env_error")


@dataclass
class Turn:
    start: int  # offset of the turn's first model token in response_ids
    num_model_tokens: int
    num_observation_tokens: int = 0
    finish_reason: str = "stop"  # the engine's: "stop" or "length"
    policy_version: int = 0
    tool_statuses: list[str] = field(default_factory=list)  # one per tool call of the turn


@dataclass
class Trajectory:
    sample_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    end_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    tool_wall_s: float = 0.0
    # Every image of prompt + observations, in order (the prompt's payload object until an
    # observation adds images): what the engine was sent and the trainer rebuilds.
    media: MediaPayload | None = None

    def add_model_turn(
        self, token_ids: list[int], logprobs: list[float], finish_reason: str, version: int
    ) -> Turn:
        assert len(token_ids) == len(logprobs)
        turn = Turn(len(self.response_ids), len(token_ids), 0, finish_reason, version)
        self.turns.append(turn)
        self.response_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.rollout_logprobs += logprobs
        return turn

    def add_observation(self, token_ids: list[int]) -> None:
        assert self.turns and self.turns[-1].num_observation_tokens == 0
        self.turns[-1].num_observation_tokens = len(token_ids)
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.rollout_logprobs += [0.0] * len(token_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_tool_calls(self) -> int:
        return sum(len(t.tool_statuses) for t in self.turns)

    @property
    def tool_status_counts(self) -> dict[str, int]:
        """Tool calls per status, without ``ok`` (an empty dict: every call worked)."""
        counts = Counter(s for t in self.turns for s in t.tool_statuses if s != "ok")
        return dict(sorted(counts.items()))

    @property
    def num_tool_errors(self) -> int:
        return sum(self.tool_status_counts.values())

    @property
    def num_observation_tokens(self) -> int:
        return len(self.loss_mask) - sum(self.loss_mask)

    @property
    def policy_version(self) -> int:
        """The oldest weights that wrote a token of it (the staleness that counts)."""
        return min((t.policy_version for t in self.turns), default=0)


def to_sample(trajectory: Trajectory, group_id: str, data_index: int) -> Sample:
    """The spool sample of ``trajectory`` (see the module docstring for the mapping)."""
    t = trajectory
    return Sample(
        sample_id=t.sample_id,
        group_id=group_id,
        data_index=data_index,
        prompt_token_ids=np.asarray(t.prompt_ids, dtype=np.int32),
        response_token_ids=np.asarray(t.response_ids, dtype=np.int32),
        loss_mask=np.asarray(t.loss_mask, dtype=np.uint8),
        rollout_logprobs=np.asarray(t.rollout_logprobs, dtype=np.float32),
        reward=float(t.reward),
        policy_version=t.policy_version,
        finish_reason=t.end_reason,
        num_turns=t.num_turns,
        media=t.media,
        timings_s={"episode": round(t.wall_s, 4), "tools": round(t.tool_wall_s, 4)},
        reward_details=reward_failure(t.info),
        metadata={
            "turns": [
                [turn.start, turn.num_model_tokens, turn.num_observation_tokens] for turn in t.turns
            ],
            "tool_calls": t.num_tool_calls,
            "tool_status": t.tool_status_counts,
            "observation_tokens": t.num_observation_tokens,
            "env": t.info,
        },
    )


def reward_failure(info: dict[str, Any]) -> dict[str, Any]:
    """The environment could not compute the reward (its ``info["reward_failed"]`` says
    why): the sample's ``Sample.reward_failed`` flag and reason."""
    reason = info.get("reward_failed")
    return {"reward_failed": True, "failed": str(reason)} if reason else {}


def episode_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per-batch means and shares under ``agent/`` (one value per name, 0 for no episodes)."""
    count = max(len(trajectories), 1)
    tokens = sum(len(t.response_ids) for t in trajectories)
    calls = sum(t.num_tool_calls for t in trajectories)
    statuses: Counter[str] = Counter()
    for t in trajectories:
        statuses.update(t.tool_status_counts)
    metrics = {
        "agent/turns_mean": sum(t.num_turns for t in trajectories) / count,
        "agent/response_tokens_mean": tokens / count,
        "agent/observation_token_share": sum(t.num_observation_tokens for t in trajectories)
        / max(tokens, 1),
        "agent/tool_calls_mean": calls / count,
        "agent/tool_error_rate": sum(statuses.values()) / max(calls, 1),
        "agent/tool_timeouts": float(statuses["timeout"]),
        "agent/episode_s_mean": sum(t.wall_s for t in trajectories) / count,
    }
    for reason in END_REASONS:
        share = sum(t.end_reason == reason for t in trajectories) / count
        metrics[f"agent/end_{reason}"] = share
    return metrics
