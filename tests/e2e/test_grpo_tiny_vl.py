"""grpo_tiny_vl as a user runs it: a tiny Qwen3-VL learns to count shapes only by looking.

Two runs of ``python -m relax_hpc.submit +experiment=grpo_tiny_vl``: with the images, and
with ``data.blank_media=true`` (the same prompts and answers, every image grey). The warm
start answers "1" unless it is sure (greedy held-out accuracy at chance, 25%); GRPO lifts
the run that sees the images far above chance, and the blind control stays there. Both
go through the whole path: data -> rollout -> spool -> trainer -> weight sync -> export.
"""

from __future__ import annotations

import pytest
from e2e_helpers import learns_from_media_not_blank

pytestmark = pytest.mark.slow

# The spool stores a group's image once: 16 groups of 8 samples with a 64x64 image each
# are ~260 KB per step; an image per sample would add 16 x 7 x 12,288 bytes (1.4 MB).
MAX_SHARD_BYTES_PER_STEP = 600_000
STEPS = 20


def test_grpo_tiny_vl_learns_from_the_images_and_not_from_blank_ones(tmp_path):
    learns_from_media_not_blank(tmp_path, "grpo_tiny_vl", STEPS, MAX_SHARD_BYTES_PER_STEP)
