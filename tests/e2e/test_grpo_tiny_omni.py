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

import time

import pytest
from e2e_helpers import eval_history, failure_report, scalars, submit

from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.slow

# The spool stores a group's clip once: 16 groups of 8 samples with 1 s of float32 audio at
# 16 kHz (64 KB) each; a clip per sample would add 16 x 7 x 64,000 bytes (7.2 MB).
MAX_SHARD_BYTES_PER_STEP = 1_500_000
STEPS = 10


def run(run_dir, *overrides: str) -> tuple[list[dict], float]:
    started = time.monotonic()
    result = submit(run_dir, *overrides, experiment="grpo_tiny_omni", timeout_s=900)
    assert result.returncode == 0, failure_report(result, run_dir)
    assert "held-out greedy accuracy" in result.stderr
    return eval_history(run_dir), time.monotonic() - started


def test_grpo_tiny_omni_learns_from_the_clips_and_not_from_silence(tmp_path):
    hearing, hearing_s = run(tmp_path / "audio")
    deaf, deaf_s = run(tmp_path / "blank", "data.blank_media=true")
    print(f"audio: {hearing} in {hearing_s:.0f} s; silence: {deaf} in {deaf_s:.0f} s")
    base, final = hearing[0], hearing[-1]
    assert (base["policy_version"], final["policy_version"]) == (0, STEPS)
    assert final["accuracy"] >= max(0.8, base["accuracy"] + 0.3), hearing
    assert deaf[-1]["policy_version"] == STEPS
    assert deaf[-1]["accuracy"] <= final["accuracy"] - 0.3, deaf

    rollout = scalars(RunPaths(tmp_path / "audio").rollout_tensorboard_dir(0))
    shard_bytes = [b for b in rollout["spool/shard_bytes"] if b > 0]
    assert shard_bytes and max(shard_bytes) < MAX_SHARD_BYTES_PER_STEP, shard_bytes
    assert rollout["data/train_rows_skipped"][-1] == 0
