"""Trainer side: claims, deterministic order, staleness, duplicates, bad shards, timeouts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spool_factories import make_group, make_sample, rewritten

from relax_hpc.spool import (
    ShardVersionError,
    ShardWriter,
    SpoolConfig,
    SpoolReader,
    SpoolTimeout,
    publish_groups,
)
from relax_hpc.spool.layout import SpoolLayout, list_names
from relax_hpc.spool.quarantine import list_quarantined


def _ids(groups) -> list[str]:
    return [g[0].group_id for g in groups]


def _reader(spool: Path, **config) -> SpoolReader:
    return SpoolReader(spool, SpoolConfig(poll_s=0.01, **config))


def test_batches_follow_publish_order_across_shards(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, "w0", shard_max_samples=6)
    writer.publish([make_group(f"a{i}") for i in range(3)])  # shards [a0 a1] [a2]
    writer.publish([make_group(f"b{i}") for i in range(2)])  # shard [b0 b1]
    reader = _reader(tmp_path)
    assert _ids(reader.next_batch(3, policy_version=0)) == ["a0", "a1", "a2"]
    assert _ids(reader.next_batch(2, policy_version=0)) == ["b0", "b1"]
    reader.mark_step_consumed(1)
    assert len(list_names(SpoolLayout(tmp_path).claimed_dir)) == 3  # kept until a checkpoint
    assert reader.metrics()["spool/num_delivered_groups"] == 5


def test_stale_groups_are_dropped_whole_and_counted(tmp_path: Path) -> None:
    mixed = [
        make_sample("m0", "mixed", policy_version=3),
        make_sample("m1", "mixed", policy_version=1),
    ]
    groups = [
        make_group("old", 2, policy_version=1),
        mixed,
        make_group("fresh", 2, policy_version=2),
    ]
    publish_groups(tmp_path, groups, "w0")
    reader = _reader(tmp_path, max_staleness=1)
    assert _ids(reader.next_batch(1, policy_version=3)) == ["fresh"]
    reader.mark_step_consumed(1)
    metrics = reader.metrics()
    assert metrics["spool/num_stale_groups"] == 2 and metrics["spool/num_stale_samples"] == 4
    assert metrics["spool/staleness_max"] == 1


def test_staleness_check_can_be_disabled(tmp_path: Path) -> None:
    publish_groups(tmp_path, [make_group("old", policy_version=0)], "w0")
    assert _ids(_reader(tmp_path, max_staleness=-1).next_batch(1, policy_version=100)) == ["old"]


def test_duplicate_sample_ids_are_never_delivered_twice(tmp_path: Path) -> None:
    publish_groups(tmp_path, [make_group("a"), make_group("b")], "w0")
    publish_groups(tmp_path, [make_group("a"), make_group("c")], "w0")  # a restarted worker
    reader = _reader(tmp_path)
    assert _ids(reader.next_batch(3, policy_version=0)) == ["a", "b", "c"]
    reader.mark_step_consumed(1)
    assert reader.metrics()["spool/num_duplicate_groups"] == 1
    assert reader.metrics()["spool/num_duplicate_samples"] == 3


def test_timeout_consumes_nothing(tmp_path: Path) -> None:
    publish_groups(tmp_path, [make_group("a")], "w0")
    reader = _reader(tmp_path)
    with pytest.raises(SpoolTimeout, match="1 of 2 groups"):
        reader.next_batch(2, policy_version=0, timeout_s=0.05)
    publish_groups(tmp_path, [make_group("b")], "w0")
    assert _ids(reader.next_batch(2, policy_version=0, timeout_s=5)) == ["a", "b"]


def test_bad_shards_are_quarantined_and_training_continues(tmp_path: Path) -> None:
    layout = SpoolLayout(tmp_path)
    (good,) = publish_groups(tmp_path, [make_group("good")], "w0")
    (truncated,) = publish_groups(tmp_path, [make_group("lost")], "w0")
    truncated.write_bytes(truncated.read_bytes()[:300])
    (layout.ready_dir / "000-stray.h5").write_bytes(b"not a shard")
    publish_groups(tmp_path, [make_group("later")], "w0")
    reader = _reader(tmp_path)
    assert _ids(reader.next_batch(2, policy_version=0)) == ["good", "later"]
    reader.mark_step_consumed(1)
    quarantined = {q.name: q.reason for q in list_quarantined(layout)}
    assert set(quarantined) == {"000-stray.h5", f"c0000000001-{truncated.name}"}
    assert "truncated" in quarantined[f"c0000000001-{truncated.name}"]
    assert reader.metrics()["spool/num_quarantined_shards"] == 2
    assert reader.metrics()["spool/num_lost_groups"] == 1


def test_shard_from_newer_code_stops_the_trainer_without_losing_it(tmp_path: Path) -> None:
    (path,) = publish_groups(tmp_path, [make_group("a")], "w0")
    with rewritten(path, header_checksum=True) as h5:  # a writer of a newer version
        h5.attrs["schema_version"] = 99
    reader = _reader(tmp_path)
    with pytest.raises(ShardVersionError, match="newer"):
        reader.next_batch(1, policy_version=0)
    assert list_names(SpoolLayout(tmp_path).claimed_dir) == [f"c0000000000-{path.name}"]
    assert list_quarantined(SpoolLayout(tmp_path)) == []


def test_vanished_claimed_shard_is_counted_missing(tmp_path: Path) -> None:
    publish_groups(tmp_path, [make_group("a"), make_group("b")], "w0")
    reader = _reader(tmp_path)
    reader.next_batch(1, policy_version=0)
    reader.mark_step_consumed(1)
    state = reader.state_dict()
    layout = SpoolLayout(tmp_path)
    for name in list_names(layout.claimed_dir):
        (layout.claimed_dir / name).unlink()  # deleted by hand, half consumed
    resumed = _reader(tmp_path)
    resumed.load_state_dict(state)
    counters = json.loads(resumed.state_dict()["spool_ledger"])["counters"]
    assert counters["num_missing_shards"] == 1 and counters["num_lost_groups"] == 1
    with pytest.raises(SpoolTimeout):
        resumed.next_batch(1, policy_version=0, timeout_s=0.02)


def test_misuse_is_a_value_error(tmp_path: Path) -> None:
    publish_groups(tmp_path, [make_group("a"), make_group("b")], "w0")
    reader = _reader(tmp_path)
    state = reader.state_dict()
    reader.next_batch(1, policy_version=0)
    reader.mark_step_consumed(1)
    with pytest.raises(ValueError, match="greater than"):
        reader.mark_step_consumed(1)
    with pytest.raises(ValueError, match="before the first next_batch"):
        reader.load_state_dict(state)
    with pytest.raises(ValueError, match="num_groups"):
        reader.next_batch(0, policy_version=0)
    with pytest.raises(ValueError, match="after the last consumed step"):
        reader.on_checkpoint_complete(2)
