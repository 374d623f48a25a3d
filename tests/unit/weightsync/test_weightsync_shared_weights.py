"""``SharedWeights``: named tensors through one memfd, seen by a second mapping of the same
descriptor (as the send process sees them) without a copy."""

from __future__ import annotations

import os

import pytest
import torch

from relax_hpc.weightsync.shared_weights import ALIGN_BYTES, SharedWeights, place


def _state(scale: float) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * scale,
        "norm.weight": torch.full((5,), scale, dtype=torch.bfloat16),
        "step": torch.tensor([int(scale)], dtype=torch.int64),
        "empty": torch.zeros(0, 7),
    }


def test_a_second_mapping_sees_each_write_exactly():
    writer = SharedWeights()
    reader = SharedWeights(os.dup(writer.fd))  # the child's end: the same file
    try:
        for scale in (1.0, 3.0):
            state = _state(scale)
            seen = reader.read(writer.write(state))
            assert list(seen) == list(state)
            for name, tensor in state.items():
                assert seen[name].dtype == tensor.dtype and torch.equal(seen[name], tensor)
    finally:
        writer.close()
        reader.close()


def test_offsets_are_aligned_and_the_file_grows_for_larger_weights():
    writer = SharedWeights()
    reader = SharedWeights(os.dup(writer.fd))
    try:
        small = writer.write({"a": torch.ones(3)})
        assert [t.offset % ALIGN_BYTES for t in place(_state(1.0)).tensors] == [0, 0, 0, 0]
        views = reader.read(small)
        big = {"a": torch.ones(3), "b": torch.arange(100_000, dtype=torch.float64)}
        placement = writer.write(big)
        assert placement.num_bytes > small.num_bytes
        assert torch.equal(reader.read(placement)["b"], big["b"])
        assert torch.equal(views["a"], torch.ones(3))  # an older view stays valid
    finally:
        writer.close()
        reader.close()


def test_a_placement_larger_than_the_file_is_refused():
    writer = SharedWeights()
    try:
        placement = place({"a": torch.ones(1000)})  # never written: the file is empty
        with pytest.raises(ValueError, match="the placement needs"):
            writer.read(placement)
    finally:
        writer.close()
