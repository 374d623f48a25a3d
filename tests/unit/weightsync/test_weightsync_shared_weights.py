"""``SharedWeights``: named tensors through one memfd, seen by a second mapping of the same
descriptor (as the send process sees them) without a copy."""

from __future__ import annotations

import os

import pytest
import torch

from relax_hpc.weightsync.protocol import ALIGN_BYTES
from relax_hpc.weightsync.shared_weights import SharedWeights, place


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
        assert placement.total_nbytes > small.total_nbytes
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


def test_a_write_of_the_same_layout_keeps_its_placement_and_the_reader_its_views():
    writer = SharedWeights()
    reader = SharedWeights(os.dup(writer.fd))
    try:
        first = writer.write(_state(1.0))
        views = reader.read(first)
        second = writer.write(_state(2.0))
        assert second is first  # nothing new to send to the reader
        again = reader.read_last()
        assert all(again[n].data_ptr() == views[n].data_ptr() for n in views)
        assert torch.equal(again["embed.weight"], _state(2.0)["embed.weight"])
        renamed = writer.write({"other": torch.ones(3)})
        assert renamed is not first and list(reader.read(renamed)) == ["other"]
    finally:
        writer.close()
        reader.close()


def test_read_last_before_any_read_is_refused():
    reader = SharedWeights()
    try:
        with pytest.raises(ValueError, match="no placement was read yet"):
            reader.read_last()
    finally:
        reader.close()
