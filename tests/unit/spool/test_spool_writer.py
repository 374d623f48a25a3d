"""Writer side: shard names, atomic publishing, splitting, backlog, temp-file cleanup."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from spool_factories import make_group

from relax_hpc.paths import read_json
from relax_hpc.spool import (
    ShardWriter,
    SpoolTimeout,
    backlog,
    publish_groups,
    read_shard,
    wait_for_room,
)
from relax_hpc.spool.layout import (
    ShardName,
    SpoolLayout,
    check_writer_id,
    claimed_name,
    list_names,
    original_name,
    parse_claimed,
    tmp_writer_pid,
)
from relax_hpc.spool.quarantine import clean_abandoned_tmp
from relax_hpc.spool.writer import split_into_shards


def test_shard_names_parse_back_and_sort_by_time() -> None:
    early = ShardName(1_700_000_000_000, "rollout.r1", 3, "deadbeef", 4, 2, 8)
    late = ShardName(1_700_000_000_001, "a", 0, "00000000", 0, 1, 1)
    assert ShardName.parse(early.name) == early
    assert sorted([late.name, early.name]) == [early.name, late.name]
    assert ShardName.parse("notes.h5") is None
    claimed = claimed_name(12, early.name)
    assert parse_claimed(claimed) == (12, early)
    assert original_name(claimed) == early.name


@pytest.mark.parametrize("writer_id", ["", "a-b", "x/y", "a" * 65])
def test_bad_writer_ids_are_rejected(writer_id: str) -> None:
    with pytest.raises(ValueError, match="writer_id"):
        check_writer_id(writer_id)


def test_split_keeps_groups_whole() -> None:
    groups = [make_group(f"g{i}", size) for i, size in enumerate([2, 3, 1, 5, 1])]
    shards = split_into_shards(groups, max_samples=4)
    assert [[len(g) for g in shard] for shard in shards] == [[2], [3, 1], [5], [1]]


def test_publish_is_atomic_and_names_are_unique(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, "rollout.r0", shard_max_samples=6)
    paths = writer.publish([make_group(f"a{i}") for i in range(5)])
    other = ShardWriter(tmp_path, "rollout.r0", shard_max_samples=6)  # restarted: same id, seq 0
    paths += other.publish([make_group(f"b{i}") for i in range(5)])
    layout = SpoolLayout(tmp_path)
    assert list_names(layout.ready_dir) == sorted(p.name for p in paths)
    assert len({p.name for p in paths}) == len(paths) == 6
    assert os.listdir(layout.tmp_dir) == []
    header, groups = read_shard(paths[0])
    parsed = ShardName.parse(paths[0].name)
    assert (
        (parsed.num_groups, parsed.num_samples) == (header.num_groups, header.num_samples) == (2, 6)
    )
    assert [g[0].group_id for g in groups] == ["a0", "a1"]
    status = read_json(layout.writer_status_path("rollout.r0"))
    assert status["num_shards"] == 6 and status["num_samples"] == 30  # refreshed on a first publish


def test_backlog_reads_names_only(tmp_path: Path) -> None:
    assert backlog(tmp_path).num_ready_groups == 0
    publish_groups(
        tmp_path, [make_group("a", policy_version=3), make_group("b", 2, policy_version=2)], "w0"
    )
    publish_groups(tmp_path, [make_group("c", 4, policy_version=5)], "w1")
    current = backlog(tmp_path)
    assert (current.num_ready_shards, current.num_ready_groups, current.num_ready_samples) == (
        2,
        3,
        9,
    )
    assert current.oldest_policy_version == 2


def test_wait_for_room_blocks_until_timeout(tmp_path: Path) -> None:
    publish_groups(tmp_path, [make_group("a"), make_group("b")], "w0")
    assert wait_for_room(tmp_path, max_ready_groups=3).num_ready_groups == 2
    assert wait_for_room(tmp_path, max_ready_groups=-1).num_ready_groups == 2
    with pytest.raises(SpoolTimeout, match="2 ready groups"):
        wait_for_room(tmp_path, max_ready_groups=2, poll_s=0.01, timeout_s=0.05)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_abandoned_temp_files_are_cleaned_safely(tmp_path: Path) -> None:
    layout = SpoolLayout(tmp_path).create()
    host = socket.gethostname()
    name = ShardName(1, "w", 0, "00000000", 0, 1, 1).name
    dead = layout.tmp_dir / f"{name}.{host}.{_dead_pid()}.0badf00d.tmp"
    alive = layout.tmp_dir / f"{name}.{host}.{os.getpid()}.0badf00d.tmp"
    remote = layout.tmp_dir / f"{name}.other-node.1.0badf00d.tmp"
    old_remote = layout.tmp_dir / f"{name}.other-node.2.0badf00d.tmp"
    status_tmp = layout.spool_dir / f"reader.json.{host}.{_dead_pid()}.12345678.tmp"
    # a quarantine reason: ".h5." before the host must not be taken for the host's start
    reason = f"c0000000001-{name}.reason.json"
    reason_tmp = layout.quarantine_dir / f"{reason}.{host}.{_dead_pid()}.0badf00d.tmp"
    old_reason_tmp = layout.quarantine_dir / f"{reason}.other-node.3.0badf00d.tmp"
    claimed_tmp = layout.claimed_dir / f"c0000000002-{name}.{host}.{_dead_pid()}.0badf00d.tmp"
    for path in (dead, alive, remote, old_remote, status_tmp, reason_tmp, old_reason_tmp,
                 claimed_tmp):  # fmt: skip
        path.write_bytes(b"partial")
    for path in (old_remote, old_reason_tmp):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    deleted = clean_abandoned_tmp(layout, max_age_s=3600)
    assert sorted(deleted) == sorted(
        p.name for p in (dead, old_remote, status_tmp, reason_tmp, old_reason_tmp, claimed_tmp)
    )
    assert alive.exists() and remote.exists()


@pytest.mark.parametrize("host", ["node1", "node1.cluster.example", "n-7_a"])
def test_a_temp_name_gives_its_writer_pid_only_for_its_own_host(host: str) -> None:
    shard = ShardName(1, "w", 0, "00000000", 0, 1, 1).name
    for final in (shard, "reader.json", f"c0000000001-{shard}.reason.json", "w.1.json"):
        name = f"{final}.{host}.4242.0badf00d.tmp"
        assert tmp_writer_pid(name, host) == 4242, name
        assert tmp_writer_pid(name, "other") is None
        assert tmp_writer_pid(name, host.split(".")[0] + "x") is None
    assert tmp_writer_pid(shard, host) is None
