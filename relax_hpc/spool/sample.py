"""One finished rollout sample, as the rollout worker hands it to the spool.

A *group* is all completions of one prompt (``list[Sample]`` with one ``group_id``);
the spool stores and delivers whole groups only. Arrays are numpy; the reader returns
read-only views into a shard's concatenated arrays, so copy before writing into them.

Must not: do I/O or import torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.media.payload import MediaPayload

Group = list["Sample"]


@dataclass
class AudioClip:
    """A waveform (``float32``, shape ``(T,)`` or ``(T, C)``) and its sample rate."""

    waveform: np.ndarray
    sample_rate_hz: int


@dataclass
class Sample:
    """One completion of one prompt, with everything the trainer needs to learn from it.

    Token-aligned arrays: ``response_token_ids``, ``loss_mask`` and ``rollout_logprobs``
    all have shape ``(R,)``; ``loss_mask`` is 0 on observation/tool tokens that the
    policy did not generate. ``policy_version`` is the version of the weights that
    generated the response (the oldest one if weights changed mid-generation).
    """

    sample_id: str  # unique, deterministic upstream from (seed, data_index, sample index)
    group_id: str
    data_index: int  # position of the prompt in the prompt dataset
    prompt_token_ids: np.ndarray  # int32 (P,)
    response_token_ids: np.ndarray  # int32 (R,)
    loss_mask: np.ndarray  # uint8 (R,), values 0/1
    rollout_logprobs: np.ndarray  # float32 (R,)
    reward: float
    policy_version: int
    finish_reason: str  # e.g. "stop", "length", "abort"
    num_turns: int = 1
    reward_details: dict[str, Any] = field(default_factory=dict)  # JSON-able
    timings_s: dict[str, float] = field(default_factory=dict)  # e.g. {"generate": 1.2}
    images: list[np.ndarray] = field(default_factory=list)  # uint8 (H, W) or (H, W, C)
    audio: list[AudioClip] = field(default_factory=list)
    # The prompt's images/audio as the processor fitted them (media/payload.py): one object
    # shared by every sample of a group, stored once per group in the shard. None: text only.
    media: MediaPayload | None = None
    metadata: dict[str, Any] = field(default_factory=dict)  # small, JSON-able

    @property
    def reward_failed(self) -> bool:
        """No reward could be computed (a judge that timed out, an endpoint that was down):
        ``reward_details["reward_failed"]``, the reason under ``"failed"``. Shards written
        before the flag carry the reason only, which says the same. The trainer masks such
        samples out of the loss; they are consumed like any other."""
        details = self.reward_details
        return bool(details.get("reward_failed") or details.get("failed"))

    @property
    def num_tokens(self) -> int:
        return int(len(self.prompt_token_ids) + len(self.response_token_ids))
