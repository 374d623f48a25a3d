"""Processes of the spool crash test: rollout writers, a checkpointing consumer, an observer.

Run as ``python spool_crash_worker.py ROLE SPOOL_DIR STATE_DIR ...``; the test kills
writers and the consumer with SIGKILL at random moments and restarts them. Every process
writes ``STATE_DIR/up/<role>-<pid>`` once its imports are done, so kills hit real work.

* writer: publishes groups ``0..num_groups-1`` of its index in random-sized batches,
  recording progress (``writer<i>.json``) after each publish; a kill between the two makes
  the restarted writer republish duplicates, as a real rollout worker would.
* consumer: the trainer's side. Resumes from its newest checkpoint, takes batches of
  ``batch_groups`` groups, checkpoints every ``checkpoint_steps`` steps (ledger + the
  history of sample ids per step), and appends each finished step to ``deliveries.jsonl``
  (including steps a later crash loses) to check that a resume replays the same batches.
  It stops once every group arrived, or the writers are done and ``ready/`` is empty.
* observer: fully reads and validates every shard it sees in ``ready/`` and ``claimed/``;
  any failure means a partial shard was visible.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from relax_hpc.paths import atomic_write_json, read_json
from relax_hpc.spool import (
    Sample,
    ShardCorruptError,
    ShardWriter,
    SpoolConfig,
    SpoolReader,
    SpoolTimeout,
    backlog,
    read_shard,
)


def group_size(writer_index: int, group_index: int) -> int:
    return 1 + (writer_index * 7 + group_index * 3) % 4


def group_sample_ids(writer_index: int, group_index: int) -> list[str]:
    return [
        f"w{writer_index}-g{group_index}-s{k}" for k in range(group_size(writer_index, group_index))
    ]


def expected_sample_ids(num_writers: int, num_groups: int) -> set[str]:
    return {
        s for w in range(num_writers) for g in range(num_groups) for s in group_sample_ids(w, g)
    }


def make_group(writer_index: int, group_index: int) -> list[Sample]:
    rng = np.random.default_rng(writer_index * 100_003 + group_index)
    samples = []
    for sample_id in group_sample_ids(writer_index, group_index):
        num_response = int(rng.integers(1, 24))
        samples.append(
            Sample(
                sample_id=sample_id,
                group_id=f"w{writer_index}-g{group_index}",
                data_index=group_index,
                prompt_token_ids=rng.integers(0, 1000, int(rng.integers(1, 16)), dtype=np.int32),
                response_token_ids=rng.integers(0, 1000, num_response, dtype=np.int32),
                loss_mask=np.ones(num_response, np.uint8),
                rollout_logprobs=rng.standard_normal(num_response).astype(np.float32),
                reward=float(rng.random()),
                policy_version=0,
                finish_reason="stop",
            )
        )
    return samples


def _mark_up(state_dir: Path, role: str) -> None:
    up = state_dir / "up"
    up.mkdir(parents=True, exist_ok=True)
    (up / f"{role}-{os.getpid()}").touch()


def run_writer(spool_dir: Path, state_dir: Path, index: int, num_groups: int) -> None:
    progress_path = state_dir / f"writer{index}.json"
    writer = ShardWriter(spool_dir, writer_id=f"crash.w{index}", shard_max_samples=10)
    rng = random.Random(os.getpid())
    _mark_up(state_dir, f"writer{index}")
    next_group = read_json(progress_path)["next_group"] if progress_path.exists() else 0
    while next_group < num_groups:
        end = min(num_groups, next_group + rng.randint(1, 5))
        writer.publish([make_group(index, g) for g in range(next_group, end)])
        atomic_write_json(progress_path, {"next_group": end})
        next_group = end
        time.sleep(rng.uniform(0.0, 0.06))  # stands in for generation time


def _latest_checkpoint(checkpoint_dir: Path) -> dict | None:
    names = sorted(p.name for p in checkpoint_dir.glob("step_*.json"))
    return read_json(checkpoint_dir / names[-1]) if names else None


def _writers_done(state_dir: Path, args: argparse.Namespace) -> bool:
    """Every writer published all its groups (and no ``STATE_DIR/hold`` asks to wait: the
    storm test holds the consumer while a shard it corrupts is out of ``ready/``)."""
    if (state_dir / "hold").exists():
        return False
    for index in range(args.num_writers):
        progress_path = state_dir / f"writer{index}.json"
        if not progress_path.exists() or read_json(progress_path)["next_group"] < args.num_groups:
            return False
    return True


def _checkpoint(reader: SpoolReader, checkpoint_dir: Path, step: int, history: list) -> None:
    state = {"step": step, "spool": reader.state_dict(), "history": history}
    atomic_write_json(checkpoint_dir / f"step_{step:08d}.json", state)
    reader.on_checkpoint_complete(step)


def run_consumer(spool_dir: Path, state_dir: Path, args: argparse.Namespace) -> None:
    """Train until every group arrived, or until the writers are done and the spool is drained
    (then samples were lost, and the test's checker says which)."""
    checkpoint_dir = state_dir / "checkpoints"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    reader = SpoolReader(spool_dir, SpoolConfig(poll_s=0.02))
    _mark_up(state_dir, "consumer")
    checkpoint = _latest_checkpoint(checkpoint_dir)
    step, history = 0, []
    if checkpoint is not None:
        reader.load_state_dict(checkpoint["spool"])
        step, history = checkpoint["step"], checkpoint["history"]
    num_groups = sum(h["num_groups"] for h in history)
    total_groups = args.num_writers * args.num_groups
    batch_groups = args.batch_groups
    with open(state_dir / "deliveries.jsonl", "a") as deliveries:
        while num_groups < total_groups:
            try:
                groups = reader.next_batch(batch_groups, policy_version=0, timeout_s=2)
            except SpoolTimeout:
                if _writers_done(state_dir, args) and backlog(spool_dir).num_ready_groups == 0:
                    if batch_groups == 1:
                        break
                    batch_groups = 1  # groups were lost (quarantined): drain one at a time
                continue
            step += 1
            ids = [s.sample_id for group in groups for s in group]
            reader.mark_step_consumed(step)
            history.append({"step": step, "num_groups": len(groups), "sample_ids": ids})
            num_groups += len(groups)
            deliveries.write(
                json.dumps({"pid": os.getpid(), "step": step, "sample_ids": ids}) + "\n"
            )
            deliveries.flush()
            if step % args.checkpoint_steps == 0:
                _checkpoint(reader, checkpoint_dir, step, history)
    if not (checkpoint_dir / f"step_{step:08d}.json").exists():
        _checkpoint(reader, checkpoint_dir, step, history)


def run_observer(spool_dir: Path, state_dir: Path) -> None:
    verified: set[str] = set()
    failures = []
    _mark_up(state_dir, "observer")
    while not (state_dir / "stop_observer").exists():
        for folder in (spool_dir / "ready", spool_dir / "claimed"):
            for path in sorted(folder.glob("*.h5")):
                if path.name in verified:
                    continue
                try:
                    read_shard(path)
                    verified.add(path.name)
                except FileNotFoundError:
                    pass  # claimed or collected between listing and reading
                except ShardCorruptError as error:
                    failures.append(f"{path}: {error}")
        time.sleep(0.01)
    atomic_write_json(
        state_dir / "observer.json", {"verified": len(verified), "failures": failures}
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["writer", "consumer", "observer"])
    parser.add_argument("spool_dir", type=Path)
    parser.add_argument("state_dir", type=Path)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--num-groups", type=int, default=0)
    parser.add_argument("--num-writers", type=int, default=0)
    parser.add_argument("--batch-groups", type=int, default=4)
    parser.add_argument("--checkpoint-steps", type=int, default=2)
    args = parser.parse_args()
    if args.role == "writer":
        run_writer(args.spool_dir, args.state_dir, args.index, args.num_groups)
    elif args.role == "consumer":
        run_consumer(args.spool_dir, args.state_dir, args)
    else:
        run_observer(args.spool_dir, args.state_dir)


if __name__ == "__main__":
    sys.exit(main())
