"""Bucket layout, packing and checksums of the weight-sync wire protocol."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax_hpc.weightsync import protocol


def _state() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(10, 7),
        "b": torch.randn(3),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "big": torch.randn(300),
    }


def _pack_all(named, layout):
    tensors = dict(named)
    buckets = [torch.zeros(n, dtype=torch.uint8) for n in layout.bucket_nbytes]
    for index, buffer in enumerate(buckets):
        protocol.pack_bucket(buffer, layout.buckets[index], tensors)
    return buckets


def test_layout_aligns_offsets_and_keeps_order():
    named = protocol.as_named_list(_state())
    layout = protocol.plan_layout(named, bucket_nbytes=512, serve_dtype=torch.bfloat16)
    assert [spec.name for spec in layout.tensors] == ["a", "b", "ids", "mask", "big"]
    assert all(spec.offset % protocol.ALIGN_BYTES == 0 for spec in layout.tensors)
    assert all(size % protocol.ALIGN_BYTES == 0 for size in layout.bucket_nbytes)
    by_name = {spec.name: spec for spec in layout.tensors}
    assert by_name["a"].dtype == "bfloat16" and by_name["ids"].dtype == "int64"
    assert by_name["big"].bucket == len(layout.bucket_nbytes) - 1  # 600 B > 512: own bucket
    assert by_name["big"].offset == 0


def test_pack_unpack_round_trip_converts_floats_on_the_sender():
    state = _state()
    named = protocol.as_named_list(state)
    layout = protocol.plan_layout(named, bucket_nbytes=256, serve_dtype=torch.bfloat16)
    received = protocol.unpack(_pack_all(named, layout), layout)
    for name, tensor in state.items():
        expected = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert received[name].dtype == expected.dtype
        assert torch.equal(received[name], expected)


@settings(max_examples=30, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=8),
    bucket_nbytes=st.integers(64, 1024),
    serve=st.sampled_from([None, torch.float16, torch.bfloat16]),
)
def test_round_trip_for_any_shapes_and_bucket_size(shapes, bucket_nbytes, serve):
    named = [(f"t{i}", torch.randn(tuple(shape))) for i, shape in enumerate(shapes)]
    layout = protocol.plan_layout(named, bucket_nbytes, serve)
    received = protocol.unpack(_pack_all(named, layout), layout)
    for name, tensor in named:
        assert torch.equal(received[name], tensor.to(serve or tensor.dtype))


def test_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        protocol.plan_layout([("x", torch.zeros(2)), ("x", torch.zeros(2))], 64, None)


@pytest.mark.parametrize(
    "algo", [protocol.CHECKSUM_XXH3, protocol.CHECKSUM_CRC32, protocol.CHECKSUM_WSUM64]
)
def test_checksum_detects_a_flipped_bit_and_swapped_words(algo):
    buffer = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    reference = protocol.bucket_checksum(buffer, algo)
    assert protocol.bucket_checksum(buffer.clone(), algo) == reference
    flipped = buffer.clone()
    flipped[1234] ^= 0x04
    assert protocol.bucket_checksum(flipped, algo) != reference
    words = buffer.clone().view(torch.int32)
    words[[3, 700]] = words[[700, 3]]
    if not torch.equal(words[3], words[700]):
        assert protocol.bucket_checksum(words.view(torch.uint8), algo) != reference


def test_wsum64_matches_a_slow_reference():
    buffer = torch.randint(0, 256, (256,), dtype=torch.uint8)
    words = buffer.view(torch.int32).tolist()
    expected = sum(w * (i + 1) for i, w in enumerate(words)) % 2**64
    assert protocol.bucket_checksum(buffer, protocol.CHECKSUM_WSUM64) == expected


def test_manifest_json_round_trip():
    named = protocol.as_named_list(_state())
    layout = protocol.plan_layout(named, 256, torch.bfloat16)
    manifest = protocol.Manifest(7, 3, protocol.CHECKSUM_CRC32, layout)
    assert protocol.Manifest.from_json(manifest.to_json()) == manifest


def test_a_manifest_reuses_its_layouts_specs_without_sharing_them():
    """The specs' JSON is built once per layout (it is the same every sync); each manifest
    gets its own dicts, so a caller changing one cannot change the next round's plan."""
    named = protocol.as_named_list(_state())
    layout = protocol.plan_layout(named, 256, torch.bfloat16)
    first = protocol.Manifest(7, 3, protocol.CHECKSUM_CRC32, layout).to_json()
    assert first["tensors"] == [dataclasses.asdict(spec) for spec in layout.tensors]
    first["tensors"][0]["name"] = "changed"
    second = protocol.Manifest(8, 4, protocol.CHECKSUM_CRC32, layout).to_json()
    assert second["tensors"][0]["name"] == layout.tensors[0].name
    assert protocol.Manifest.from_json(second).layout == layout


def test_cpu_buffers_are_checksummed_with_xxh3_and_unknown_algorithms_refused():
    assert protocol.checksum_algo_for(torch.device("cpu")) == protocol.CHECKSUM_XXH3
    assert protocol.checksum_algo_for(torch.device("cuda", 0)) == protocol.CHECKSUM_WSUM64
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md4'"):
        protocol.bucket_checksum(torch.zeros(64, dtype=torch.uint8), "md4")
