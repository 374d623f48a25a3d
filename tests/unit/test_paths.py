"""The run-directory layout and atomic writes."""

from __future__ import annotations

import os
import stat

import pytest

from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import (
    RunPaths,
    atomic_write_bytes,
    atomic_write_json,
    exclusive_create_json,
    read_json,
)
from relax_hpc.rollout.assignment import WorkerHeartbeat


@pytest.fixture
def fsyncs(monkeypatch) -> list[str]:
    """What each ``os.fsync`` flushed ('file' or 'dir'), in order; the real fsync still runs."""
    flushed: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        flushed.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return flushed


def test_atomic_write_leaves_no_temp_files_and_sets_the_mode(tmp_path):
    target = tmp_path / "sub" / "token"
    atomic_write_bytes(target, b"secret", mode=0o600)
    atomic_write_bytes(target, b"secret2", mode=0o600)
    assert target.read_bytes() == b"secret2"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert os.listdir(target.parent) == ["token"]


def test_a_write_that_fails_midway_keeps_the_old_file(tmp_path, monkeypatch):
    target = tmp_path / "data.json"
    atomic_write_json(target, {"a": 1})

    def crash(*_):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", crash)  # fails after the temp file has been written
    with pytest.raises(OSError, match="disk full"):
        atomic_write_json(target, {"a": 2})
    monkeypatch.undo()
    assert read_json(target) == {"a": 1}
    assert os.listdir(tmp_path) == ["data.json"]


def test_a_durable_write_flushes_file_and_directory_an_advisory_one_neither(tmp_path, fsyncs):
    target = tmp_path / "status.json"
    atomic_write_json(target, {"step": 1})
    assert fsyncs == ["file", "dir"]
    fsyncs.clear()
    atomic_write_json(target, {"step": 2}, durable=False)
    assert fsyncs == []
    assert read_json(target) == {"step": 2}
    assert os.listdir(tmp_path) == ["status.json"]


def test_exclusive_create_flushes_the_content_before_the_name_exists(tmp_path, fsyncs):
    assert exclusive_create_json(tmp_path / "a.claim", {"worker": "r0"})
    assert fsyncs == ["file", "dir"]  # the temp file, then the link's directory
    fsyncs.clear()
    assert exclusive_create_json(tmp_path / "b.claim", {"worker": "r0"}, durable=False)
    # a crash may lose the name or its content: the callers' readers take an unreadable
    # file for a crash's leftover (rollout/assignment.py)
    assert fsyncs == []
    assert not exclusive_create_json(tmp_path / "b.claim", {"worker": "r1"}, durable=False)
    assert read_json(tmp_path / "b.claim") == {"worker": "r0"}
    assert sorted(os.listdir(tmp_path)) == ["a.claim", "b.claim"]


def test_per_step_status_and_heartbeat_files_are_not_fsynced(tmp_path, fsyncs):
    """Advisory files rewritten every step or every few seconds (paths' docstring)."""
    MetricsLogger(None, tmp_path / "trainer.json").log(3, {"loss/policy": 0.5})
    WorkerHeartbeat(tmp_path, "r0", interval_s=1.0).beat()
    assert fsyncs == []
    assert read_json(tmp_path / "trainer.json")["step"] == 3
    assert read_json(tmp_path / "workers" / "r0.json")["left"] is False


def test_run_paths_layout(tmp_path):
    paths = RunPaths(tmp_path / "run").create()
    assert paths.resolved_config == paths.root / "config.yaml"
    assert paths.weights_version_dir(3).name == "v3"
    assert paths.checkpoint_dir(12).name == "step_00000012"
    assert paths.task_log("trainer", 0) == paths.root / "logs" / "trainer-0.log"
    assert stat.S_IMODE(paths.rendezvous_dir.stat().st_mode) == 0o700
    for folder in (paths.spool_dir, paths.weights_dir, paths.checkpoints_dir, paths.events_dir):
        assert folder.is_dir()
