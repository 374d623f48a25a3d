"""Quarantine and requeue: bad shards move aside with a reason and come back after a fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from spool_factories import make_group

from relax_hpc.spool import SpoolConfig, SpoolReader, publish_groups
from relax_hpc.spool.layout import REASON_SUFFIX, SpoolLayout, list_names
from relax_hpc.spool.quarantine import list_quarantined, quarantine_shard, requeue


def _ids(groups) -> list[str]:
    return [g[0].group_id for g in groups]


def test_requeue_after_a_fix_delivers_the_shard(tmp_path: Path) -> None:
    layout = SpoolLayout(tmp_path)
    (path,) = publish_groups(tmp_path, [make_group("a"), make_group("b")], "w0")
    good_bytes = path.read_bytes()
    path.write_bytes(good_bytes[:100])  # e.g. a filesystem incident
    reader = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01))
    with pytest.raises(TimeoutError):
        reader.next_batch(1, policy_version=0, timeout_s=0.05)
    (quarantined,) = list_quarantined(layout)
    assert "truncated" in quarantined.reason and quarantined.quarantined_unix_s is not None
    (layout.quarantine_dir / quarantined.name).write_bytes(good_bytes)  # the operator's fix
    assert requeue(layout) == [path.name]
    assert list_names(layout.quarantine_dir, suffix="") == []
    assert _ids(reader.next_batch(2, policy_version=0, timeout_s=5)) == ["a", "b"]


def test_requeued_shard_never_delivers_a_group_twice(tmp_path: Path) -> None:
    layout = SpoolLayout(tmp_path)
    publish_groups(tmp_path, [make_group("a"), make_group("b")], "w0")
    reader = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01))
    assert _ids(reader.next_batch(1, policy_version=0)) == ["a"]
    reader.mark_step_consumed(1)
    (claimed,) = list_names(layout.claimed_dir)
    quarantine_shard(layout, layout.claimed_dir / claimed, "operator suspicion")
    requeue(layout, [claimed])
    resumed = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01))
    resumed.load_state_dict(reader.state_dict())
    assert _ids(resumed.next_batch(1, policy_version=0, timeout_s=5)) == ["b"]
    resumed.mark_step_consumed(2)
    assert resumed.metrics()["spool/num_duplicate_groups"] == 1


def test_orphan_reason_files_are_ignored_and_cleaned(tmp_path: Path) -> None:
    layout = SpoolLayout(tmp_path).create()
    (layout.quarantine_dir / ("gone.h5" + REASON_SUFFIX)).write_text("{}")
    assert list_quarantined(layout) == []
    assert requeue(layout) == []
    assert list_names(layout.quarantine_dir, suffix="") == []


def test_requeue_of_an_unknown_name_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not in quarantine: nope.h5"):
        requeue(SpoolLayout(tmp_path).create(), ["nope.h5"])
