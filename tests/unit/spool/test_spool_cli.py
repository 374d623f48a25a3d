"""Operator CLI on a spool written by the test: status, ls, inspect, quarantine, requeue."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from spool_factories import make_full_sample, make_group

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import ShardWriter, SpoolConfig, SpoolReader
from relax_hpc.spool.cli import inspect_lines, main
from relax_hpc.spool.layout import SpoolLayout, list_names

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run whose spool has ready, claimed and quarantined shards and a consumed step."""
    paths = RunPaths(tmp_path / "run").create()
    writer = ShardWriter(paths.spool_dir, "rollout.r0", shard_max_samples=3)
    writer.publish([make_group("a", policy_version=1), make_group("b", policy_version=2)])
    writer.publish([[make_full_sample("m0", "mm", 1), make_full_sample("m1", "mm", 2)]])
    reader = SpoolReader(paths.spool_dir, SpoolConfig(poll_s=0.01))
    reader.next_batch(1, policy_version=2)
    reader.mark_step_consumed(1)
    (SpoolLayout(paths.spool_dir).ready_dir / "0junk.h5").write_bytes(b"junk")
    return paths.root


def test_status_counts_per_state_and_version(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(run_dir), "status"]) == 0
    out = capsys.readouterr().out
    ready = next(line for line in out.splitlines() if line.startswith("ready"))
    assert ready.split()[1:4] == ["3", "2", "5"]  # shards incl. junk, groups, samples
    assert "  v2: 1 shards, 3 samples\n  v7: 1 shards, 2 samples\n" in out
    assert "rollout.r0" in out and "trainer: step 1" in out


def test_ls_inspect_quarantine_requeue(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(run_dir), "ls"]) == 0
    listing = capsys.readouterr().out
    assert "claimed" in listing and "0junk.h5" in listing
    mm_shard = next(
        n for n in list_names(SpoolLayout(RunPaths(run_dir).spool_dir).ready_dir) if "-s2" in n
    )
    assert main([str(run_dir), "inspect", mm_shard, "--limit", "1"]) == 0
    shown = capsys.readouterr().out
    assert (
        "sample m0" in shown
        and "images: [(6, 5, 3), (4, 2)]" in shown
        and "1 more samples" in shown
    )
    assert "(3 masked)" in shown and "metadata" in shown
    SpoolReader(RunPaths(run_dir).spool_dir, SpoolConfig(poll_s=0.01)).next_batch(
        2, policy_version=2
    )
    assert main([str(run_dir), "quarantine"]) == 0
    assert "0junk.h5\n    not a spool shard name" in capsys.readouterr().out
    assert main([str(run_dir), "requeue"]) == 2
    assert main([str(run_dir), "requeue", "0junk.h5"]) == 0
    assert capsys.readouterr().out.strip() == "requeued 0junk.h5"
    assert main([str(run_dir), "inspect", "missing.h5"]) == 1


def test_inspect_decodes_tokens_with_a_tokenizer(run_dir: Path) -> None:
    layout = SpoolLayout(RunPaths(run_dir).spool_dir)
    path = layout.ready_dir / list_names(layout.ready_dir)[-1]
    lines = inspect_lines(path, limit=1, decode=lambda ids: f"<{len(ids)} tokens>")
    assert "    prompt: '<5 tokens>'" in lines


def test_module_entry_point(run_dir: Path) -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-m", "relax_hpc.spool", str(run_dir), "status"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert done.stdout.startswith("spool ")


def test_reader_status_is_rewritten_at_most_once_a_second_and_at_every_checkpoint(
    tmp_path: Path,
) -> None:
    """reader.json is advisory: between checkpoints it may lag the ledger by up to a second
    (each rewrite costs the trainer's step), but a checkpoint always brings it up to date."""
    now = [100.0]
    writer = ShardWriter(tmp_path, "rollout.r0", shard_max_samples=2)
    for name in "abcd":
        writer.publish([make_group(name, policy_version=0)])
    reader = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01), clock=lambda: now[0])
    status_path = SpoolLayout(tmp_path).reader_status_path

    def shown_step() -> int:
        return read_json(status_path)["step"]

    for step in (1, 2):
        reader.next_batch(1, policy_version=0)
        reader.mark_step_consumed(step)
    assert shown_step() == 1  # step 2 came within the second
    now[0] += 1.0
    reader.next_batch(1, policy_version=0)
    reader.mark_step_consumed(3)
    assert shown_step() == 3
    reader.next_batch(1, policy_version=0)
    reader.mark_step_consumed(4)
    assert shown_step() == 3
    reader.on_checkpoint_complete(4)
    status = read_json(status_path)
    assert (status["step"], status["checkpointed_step"]) == (4, 4)
    assert status["counters"]["num_delivered_samples"] == sum(
        len(g) for g in [make_group(n, policy_version=0) for n in "abcd"]
    )
