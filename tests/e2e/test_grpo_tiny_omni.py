"""grpo_tiny_omni as a user runs it: a tiny Qwen2.5-Omni thinker learns which of four tones
it hears only by listening.

Two runs of ``python -m relax_hpc.submit +experiment=grpo_tiny_omni``: with the clips, and
with ``data.blank_media=true`` (the same prompts and answers, every clip silence of the same
length). The warm start answers "1" unless it is sure (greedy held-out accuracy at chance,
25%); GRPO lifts the run that hears the clips far above chance, and the deaf control stays
there. Both go through the whole path: data -> rollout -> spool -> trainer -> weight sync
-> export.
"""

from __future__ import annotations

import pytest
from e2e_helpers import learns_from_media_not_blank

pytestmark = pytest.mark.slow

# The spool stores a group's clip once: 16 groups of 8 samples with 1 s of float32 audio at
# 16 kHz (64 KB) each; a clip per sample would add 16 x 7 x 64,000 bytes (7.2 MB).
MAX_SHARD_BYTES_PER_STEP = 1_500_000
STEPS = 10


def test_grpo_tiny_omni_learns_from_the_clips_and_not_from_silence(tmp_path):
    learns_from_media_not_blank(tmp_path, "grpo_tiny_omni", STEPS, MAX_SHARD_BYTES_PER_STEP)
