"""The run-directory layout and atomic writes."""

from __future__ import annotations

import os
import stat

import pytest

from relax_hpc.paths import RunPaths, atomic_write_bytes, atomic_write_json, read_json


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


def test_run_paths_layout(tmp_path):
    paths = RunPaths(tmp_path / "run").create()
    assert paths.resolved_config == paths.root / "config.yaml"
    assert paths.weights_version_dir(3).name == "v3"
    assert paths.checkpoint_dir(12).name == "step_00000012"
    assert paths.task_log("trainer", 0) == paths.root / "logs" / "trainer-0.log"
    assert stat.S_IMODE(paths.rendezvous_dir.stat().st_mode) == 0o700
    for folder in (paths.spool_dir, paths.weights_dir, paths.checkpoints_dir, paths.events_dir):
        assert folder.is_dir()
