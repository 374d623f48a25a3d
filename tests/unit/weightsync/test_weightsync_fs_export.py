"""The filesystem export weights/v{N}/: atomic publication, verified loading, pruning."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightVerificationError, fs_export


def _state(version: int) -> dict[str, torch.Tensor]:
    weight = torch.full((4, 3), float(version))
    # tied weights share storage; safetensors alone would refuse them
    return {"embed": weight, "lm_head": weight, "steps": torch.tensor([version])}


def test_publish_then_load_latest_in_the_serving_dtype(tmp_path):
    paths = RunPaths(tmp_path).create()
    fs_export.publish_weights(paths, _state(1), 1, torch.bfloat16)
    folder = fs_export.publish_weights(paths, _state(2), 2, torch.bfloat16)
    assert folder == paths.weights_version_dir(2)
    version, tensors = fs_export.load_published_weights(paths)
    assert version == 2 and fs_export.latest_published_version(paths) == 2
    assert tensors["lm_head"].dtype == torch.bfloat16
    assert torch.equal(tensors["embed"], torch.full((4, 3), 2.0, dtype=torch.bfloat16))
    assert tensors["steps"].dtype == torch.int64
    assert not [p for p in paths.weights_dir.iterdir() if p.name.endswith(".tmp")]


def test_old_versions_are_pruned_and_latest_never_goes_back(tmp_path):
    paths = RunPaths(tmp_path).create()
    for version in (1, 2, 3):
        fs_export.publish_weights(paths, _state(version), version, keep_versions=2)
    fs_export.publish_weights(paths, _state(2), 2, keep_versions=2)  # idempotent re-publish
    assert fs_export.published_versions(paths) == [2, 3]
    assert fs_export.latest_published_version(paths) == 3


def test_a_corrupted_file_is_rejected(tmp_path):
    paths = RunPaths(tmp_path).create()
    folder = fs_export.publish_weights(paths, _state(1), 1)
    weights = folder / fs_export.WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(WeightVerificationError, match="does not match"):
        fs_export.load_published_weights(paths, 1)


def test_nothing_published_is_a_clear_error(tmp_path):
    paths = RunPaths(tmp_path).create()
    with pytest.raises(FileNotFoundError, match="no published weights"):
        fs_export.load_published_weights(paths)
