"""grpo_tiny_vl as a user runs it: a tiny Qwen3-VL learns to count shapes only by looking.

Two runs of ``python -m relax_hpc.submit +experiment=grpo_tiny_vl``: with the images, and
with ``data.blank_media=true`` (the same prompts and answers, every image grey). The warm
start answers "1" unless it is sure (greedy held-out accuracy at chance, 25%); GRPO lifts
the run that sees the images far above chance, and the blind control stays there. Both
go through the whole path: data -> rollout -> spool -> trainer -> weight sync -> export.
"""

from __future__ import annotations

import time

import pytest
from e2e_helpers import eval_history, failure_report, scalars, submit

from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.slow

# The spool stores a group's image once: 16 groups of 8 samples with a 64x64 image each
# are ~260 KB per step; an image per sample would add 16 x 7 x 12,288 bytes (1.4 MB).
MAX_SHARD_BYTES_PER_STEP = 600_000


def run(run_dir, *overrides: str) -> tuple[list[dict], float]:
    started = time.monotonic()
    result = submit(run_dir, *overrides, experiment="grpo_tiny_vl", timeout_s=900)
    assert result.returncode == 0, failure_report(result, run_dir)
    assert "held-out greedy accuracy" in result.stderr
    return eval_history(run_dir), time.monotonic() - started


def test_grpo_tiny_vl_learns_from_the_images_and_not_from_blank_ones(tmp_path):
    seeing, seeing_s = run(tmp_path / "images")
    blind, blind_s = run(tmp_path / "blank", "data.blank_media=true")
    print(f"images: {seeing} in {seeing_s:.0f} s; blank: {blind} in {blind_s:.0f} s")
    base, final = seeing[0], seeing[-1]
    assert (base["policy_version"], final["policy_version"]) == (0, 20)
    assert final["accuracy"] >= max(0.8, base["accuracy"] + 0.3), seeing
    assert blind[-1]["policy_version"] == 20
    assert blind[-1]["accuracy"] <= final["accuracy"] - 0.3, blind

    rollout = scalars(RunPaths(tmp_path / "images").rollout_tensorboard_dir(0))
    shard_bytes = [b for b in rollout["spool/shard_bytes"] if b > 0]
    assert shard_bytes and max(shard_bytes) < MAX_SHARD_BYTES_PER_STEP, shard_bytes
    assert rollout["data/train_rows_skipped"][-1] == 0
