"""Checkpoint and resume: the ledger hands out again exactly what a lost step consumed."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from spool_factories import make_group

from relax_hpc.spool import ShardWriter, SpoolConfig, SpoolReader, SpoolTimeout
from relax_hpc.spool.layout import SpoolLayout, list_names


def _ids(groups) -> list[str]:
    return [g[0].group_id for g in groups]


def _reader(spool: Path, **config) -> SpoolReader:
    return SpoolReader(spool, SpoolConfig(poll_s=0.01, **config))


def _publish(spool: Path, names: list[str], shard_max_samples: int = 6) -> None:
    ShardWriter(spool, "w0", shard_max_samples=shard_max_samples).publish(
        [make_group(n) for n in names]
    )


def _step(reader: SpoolReader, step: int, num_groups: int = 2) -> list[str]:
    ids = _ids(reader.next_batch(num_groups, policy_version=0, timeout_s=1))
    reader.mark_step_consumed(step)
    return ids


def test_resume_replays_steps_after_the_checkpoint_in_the_same_order(tmp_path: Path) -> None:
    _publish(tmp_path, [f"g{i}" for i in range(9)])  # shards of 2 groups: batches straddle them
    reader = _reader(tmp_path)
    assert _step(reader, 1) + _step(reader, 2) == ["g0", "g1", "g2", "g3"]
    checkpoint = reader.state_dict()
    reader.on_checkpoint_complete(2)
    lost = _step(reader, 3, num_groups=3) + _step(reader, 4)  # never checkpointed: lost
    resumed = _reader(tmp_path)
    resumed.load_state_dict(checkpoint)
    assert (
        _step(resumed, 3, num_groups=3) + _step(resumed, 4)
        == lost
        == ["g4", "g5", "g6", "g7", "g8"]
    )


def test_shards_are_deleted_only_once_a_checkpoint_covers_them(tmp_path: Path) -> None:
    _publish(tmp_path, ["a", "b", "c", "d"])
    layout = SpoolLayout(tmp_path)
    reader = _reader(tmp_path)
    _step(reader, 1)  # consumes shard [a b]
    _step(reader, 2, num_groups=1)  # claims [c d], consumes c
    assert len(list_names(layout.claimed_dir)) == 2
    reader.on_checkpoint_complete(2)
    (remaining,) = list_names(layout.claimed_dir)
    assert remaining.endswith("-g2-s6.h5")  # [c d]: d is not consumed yet


def test_asynchronous_checkpoint_collects_only_what_it_covers(tmp_path: Path) -> None:
    _publish(tmp_path, ["a", "b", "c", "d"])
    reader = _reader(tmp_path)
    _step(reader, 1)
    checkpoint_1 = reader.state_dict()
    _step(reader, 2)  # done with [c d] at step 2, while checkpoint 1 is still being saved
    reader.on_checkpoint_complete(1)
    assert len(list_names(SpoolLayout(tmp_path).claimed_dir)) == 1
    resumed = _reader(tmp_path)
    resumed.load_state_dict(checkpoint_1)
    assert _step(resumed, 2) == ["c", "d"]


def test_crash_between_checkpoint_and_collection_neither_loses_nor_repeats(tmp_path: Path) -> None:
    _publish(tmp_path, ["a", "b", "c", "d", "e", "f"])
    reader = _reader(tmp_path)
    _step(reader, 1)
    _step(reader, 2)
    checkpoint = reader.state_dict()  # written and complete, then killed before collecting
    resumed = _reader(tmp_path)
    resumed.load_state_dict(checkpoint)
    assert len(list_names(SpoolLayout(tmp_path).claimed_dir)) == 0  # collected on load
    assert _step(resumed, 3) == ["e", "f"]


def test_incomplete_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    _publish(tmp_path, ["a", "b", "c", "d", "e", "f"])
    reader = _reader(tmp_path)
    _step(reader, 1)
    checkpoint_1 = reader.state_dict()
    reader.on_checkpoint_complete(1)
    _step(reader, 2)
    reader.state_dict()  # checkpoint 2 is being written when the job dies
    resumed = _reader(tmp_path)
    resumed.load_state_dict(checkpoint_1)
    assert _step(resumed, 2) + _step(resumed, 3) == ["c", "d", "e", "f"]


def test_fresh_start_hands_out_claimed_shards_again(tmp_path: Path) -> None:
    _publish(tmp_path, ["a", "b", "c"])
    reader = _reader(tmp_path)
    _step(reader, 1)  # no checkpoint ever: training restarts from scratch
    assert _step(_reader(tmp_path), 1, num_groups=3) == ["a", "b", "c"]


def test_keep_consumed_allows_resuming_from_an_older_checkpoint(tmp_path: Path) -> None:
    _publish(tmp_path, ["a", "b", "c", "d", "e", "f"], shard_max_samples=3)  # one group per shard
    reader = _reader(tmp_path, keep_consumed=True)
    _step(reader, 1, num_groups=1)
    checkpoint_1 = reader.state_dict()
    reader.on_checkpoint_complete(1)
    lost = _step(reader, 2) + _step(reader, 3)
    reader.on_checkpoint_complete(3)  # shards of steps 2-3 move to consumed/
    assert len(list_names(SpoolLayout(tmp_path).consumed_dir)) == 5
    resumed = _reader(tmp_path, keep_consumed=True)
    resumed.load_state_dict(checkpoint_1)  # e.g. checkpoint 3 turned out to be bad
    assert _step(resumed, 2) + _step(resumed, 3) == lost == ["b", "c", "d", "e"]


def test_state_is_json_with_a_fixed_key_and_survives_torch_dcp(tmp_path: Path) -> None:
    torch_dcp = pytest.importorskip("torch.distributed.checkpoint")
    _publish(tmp_path / "spool", ["a", "b", "c", "d"])
    reader = _reader(tmp_path / "spool")
    _step(reader, 1, num_groups=3)
    state = reader.state_dict()
    assert list(state) == ["spool_ledger"]
    ledger = json.loads(state["spool_ledger"])
    assert ledger["step"] == 1 and ledger["records"][-1]["groups"][0][1:] == [0, 2]
    template = {"spool": _reader(tmp_path / "spool").state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # single process, no process group
        torch_dcp.save({"spool": state}, checkpoint_id=tmp_path / "ckpt")
        torch_dcp.load(template, checkpoint_id=tmp_path / "ckpt")
    resumed = _reader(tmp_path / "spool")
    resumed.load_state_dict(template["spool"])
    assert _step(resumed, 2, num_groups=1) == ["d"]


def test_claims_are_flushed_once_when_a_checkpoint_takes_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim's rename is made durable before a checkpoint records it, not at every claim
    (one directory fsync per checkpoint instead of one per shard on the trainer's step)."""
    import relax_hpc.spool.reader as reader_module

    flushed: list[str] = []
    real_fsync_dir = reader_module.fsync_dir

    def recording_fsync_dir(directory: Path) -> None:
        flushed.append(directory.name)
        real_fsync_dir(directory)

    monkeypatch.setattr(reader_module, "fsync_dir", recording_fsync_dir)
    _publish(tmp_path, [f"g{i}" for i in range(6)], shard_max_samples=2)  # a group a shard
    reader = _reader(tmp_path)
    _step(reader, 1)
    flushed.clear()  # the first call's recovery flushes what it found
    _step(reader, 2)
    _step(reader, 3)  # four claims so far
    assert flushed == []
    reader.state_dict()
    assert flushed == ["claimed"]
    reader.state_dict()  # nothing claimed since: nothing to flush
    assert flushed == ["claimed"]


def test_a_claim_a_crash_undid_is_claimed_again_and_trained_once(tmp_path: Path) -> None:
    """A crash may undo a claim made after the last checkpoint (its rename not yet flushed):
    the shard is back in ready/; the resumed run claims it again, once."""
    _publish(tmp_path, [f"g{i}" for i in range(6)], shard_max_samples=2)
    layout = SpoolLayout(tmp_path)
    reader = _reader(tmp_path)
    assert _step(reader, 1) == ["g0", "g1"]
    checkpoint = reader.state_dict()
    reader.on_checkpoint_complete(1)
    assert _step(reader, 2) == ["g2", "g3"]  # never checkpointed
    for claimed in list_names(layout.claimed_dir):  # what the crash left: the renames undone
        (layout.claimed_dir / claimed).rename(layout.ready_dir / claimed.split("-", 1)[1])
    resumed = _reader(tmp_path)
    resumed.load_state_dict(checkpoint)
    assert _step(resumed, 2) + _step(resumed, 3) == ["g2", "g3", "g4", "g5"]
    with pytest.raises(SpoolTimeout):
        resumed.next_batch(1, policy_version=0, timeout_s=0.05)
