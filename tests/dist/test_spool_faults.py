"""Spool faults with real processes killed by SIGKILL: a flipped payload byte, a quarantine
just before a consumer crash, and temp files left by processes killed mid-write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from spool_crash_worker import make_group
from spool_fault_worker import flip_stored_byte

from relax_hpc.paths import read_json
from relax_hpc.spool import ShardWriter, SpoolConfig, SpoolReader
from relax_hpc.spool.layout import TMP_SUFFIX, SpoolLayout, list_names
from relax_hpc.spool.quarantine import clean_abandoned_tmp, list_quarantined

WORKER = Path(__file__).with_name("spool_fault_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_until_killed(action: str, spool_dir: Path, state_dir: Path) -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, str(WORKER), action, str(spool_dir), str(state_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == -9, f"{action} was not SIGKILLed:\n{result.stderr[-3000:]}"


@pytest.fixture
def spool_with_a_corrupt_shard(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Shards A (2 groups), B (3 groups; the test corrupts it), C (2 groups), in order."""
    spool_dir, state_dir = tmp_path / "spool", tmp_path / "state"
    state_dir.mkdir()
    writer = ShardWriter(spool_dir, writer_id="fault.w0", shard_max_samples=1000)
    writer.publish([make_group(0, g) for g in (0, 1)])
    (corrupt,) = writer.publish([make_group(0, g) for g in (2, 3, 4)])
    writer.publish([make_group(0, g) for g in (5, 6)])
    return spool_dir, state_dir, corrupt


def _sample_ids(group_indices) -> list[str]:
    return [s.sample_id for g in group_indices for s in make_group(0, g)]


def test_a_flipped_payload_byte_is_quarantined_never_delivered(spool_with_a_corrupt_shard):
    spool_dir, state_dir, corrupt = spool_with_a_corrupt_shard
    flip_stored_byte(corrupt)
    _run_until_killed("consume", spool_dir, state_dir)
    assert read_json(state_dir / "taken.json") == _sample_ids([5]), "the corrupt shard's group"
    (quarantined,) = list_quarantined(SpoolLayout(spool_dir))
    assert quarantined.name.endswith(corrupt.name)
    assert "checksum mismatch in the file's seal" in quarantined.reason


def test_quarantine_counts_survive_a_consumer_crash(spool_with_a_corrupt_shard):
    """The consumer quarantines B after its step-1 checkpoint and is killed before the next:
    the resumed consumer still counts B as quarantined and its 3 groups as lost, once."""
    spool_dir, state_dir, corrupt = spool_with_a_corrupt_shard
    corrupt.write_bytes(corrupt.read_bytes()[:1000])  # truncated: the seal's length
    _run_until_killed("consume", spool_dir, state_dir)
    reader = SpoolReader(spool_dir, SpoolConfig(poll_s=0.01))
    reader.load_state_dict(read_json(state_dir / "checkpoint.json"))
    counted = reader.metrics()
    assert counted.get("spool/num_quarantined_shards") == 1
    assert counted.get("spool/num_lost_groups") == 3
    delivered = [s.sample_id for g in reader.next_batch(2, 0, timeout_s=10) for s in g]
    assert delivered == _sample_ids([5, 6]), "the crashed step is handed out again"
    reader.mark_step_consumed(2)
    again = SpoolReader(spool_dir, SpoolConfig(poll_s=0.01))
    again.load_state_dict(reader.state_dict())
    assert again.metrics()["spool/num_quarantined_shards"] == 1, "counted once"
    assert again.metrics()["spool/num_lost_groups"] == 3


def test_temp_files_of_killed_processes_are_recognised_and_cleaned(tmp_path):
    """A reason file's temp (its name holds ``.h5.`` before the host) and a shard's temp,
    each left by a process SIGKILLed before its rename, go at once: their writers are dead."""
    spool_dir, state_dir = tmp_path / "spool", tmp_path / "state"
    state_dir.mkdir()
    layout = SpoolLayout(spool_dir).create()
    (shard,) = ShardWriter(spool_dir, writer_id="fault.w1").publish([make_group(1, 0)])
    os.rename(shard, state_dir / "victim.h5")
    _run_until_killed("publish", spool_dir, state_dir)  # its writer would clean the other
    _run_until_killed("quarantine", spool_dir, state_dir)
    folders = [layout.spool_dir / name for name in os.listdir(layout.spool_dir)]
    left = {folder.name: list_names(folder, TMP_SUFFIX) for folder in folders}
    assert len(left["quarantine"]) == 1 and ".h5.reason.json." in left["quarantine"][0]
    assert len(left["tmp"]) == 1
    deleted = clean_abandoned_tmp(layout, max_age_s=3600.0)  # the bound is far away
    assert sorted(deleted) == sorted(left["quarantine"] + left["tmp"])
    assert all(list_names(folder, TMP_SUFFIX) == [] for folder in folders)
