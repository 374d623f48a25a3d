"""Shard format: every field round-trips; bad files raise the right, clear errors."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spool_factories import (
    assert_samples_equal,
    dataset_names,
    datasets_a_flip_goes_unnoticed_in,
    json_bytes,
    make_full_sample,
    make_group,
    make_sample,
    rewritten,
    text_json_start,
    text_offsets,
)

from relax_hpc.spool import SCHEMA_VERSION, AudioClip, ShardCorruptError, ShardVersionError
from relax_hpc.spool import format as format_module
from relax_hpc.spool.format import SEAL_SIZE, read_header, read_shard, write_shard_file


def _write(path: Path, groups) -> Path:
    write_shard_file(path, groups, writer_id="rollout.r0", created_unix_s=1700000000.5)
    return path


def test_every_field_round_trips_multimodal_included(tmp_path: Path) -> None:
    groups = [
        [make_full_sample("a0", "ga", 1), make_full_sample("a1", "ga", 2)],
        [make_sample("b0", "gb", policy_version=5, num_response=0)],  # empty response
        [make_full_sample("c0", "gc", 3)],
    ]
    header, read = read_shard(_write(tmp_path / "s.h5", groups))
    assert [len(g) for g in read] == [2, 1, 1]
    for got, want in zip([s for g in read for s in g], [s for g in groups for s in g], strict=True):
        assert_samples_equal(got, want)
    assert header.schema_version == SCHEMA_VERSION
    assert (header.num_groups, header.num_samples) == (3, 4)
    assert (header.min_policy_version, header.max_policy_version) == (5, 7)
    assert header.writer_id == "rollout.r0" and header.created_unix_s == 1700000000.5
    assert read_header(tmp_path / "s.h5") == header


def test_read_arrays_are_read_only_views(tmp_path: Path) -> None:
    _, groups = read_shard(_write(tmp_path / "s.h5", [make_group("g", 2)]))
    with pytest.raises(ValueError):
        groups[0][0].response_token_ids[0] = 1


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    group_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    num_response=st.integers(0, 20),
    num_images=st.integers(0, 2),
    num_audio=st.integers(0, 2),
    text=st.text(max_size=12),
)
def test_round_trip_property(
    tmp_path: Path, group_sizes, num_response, num_images, num_audio, text
) -> None:
    groups = []
    for g, size in enumerate(group_sizes):
        group = []
        for k in range(size):
            rng = np.random.default_rng(g * 10 + k)
            group.append(
                make_sample(
                    f"{text}-{g}-{k}",
                    f"{text}-{g}",
                    policy_version=g,
                    num_response=num_response,
                    finish_reason=text,
                    metadata={"text": text},
                    images=[rng.integers(0, 256, (k + 1, 2, 3), dtype=np.uint8)] * num_images,
                    audio=[AudioClip(rng.random(k + 2).astype(np.float32), 8000)] * num_audio,
                )
            )
        groups.append(group)
    path = tmp_path / f"p{len(list(tmp_path.iterdir()))}.h5"
    _, read = read_shard(_write(path, groups))
    for got, want in zip([s for g in read for s in g], [s for g in groups for s in g], strict=True):
        assert_samples_equal(got, want)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([], "at least one group"),
        ([[]], "empty"),
        ([[make_sample("a", "g1"), make_sample("b", "g2")]], "mixes group ids"),
        ([[make_sample("a", loss_mask=np.ones(2, np.uint8))]], "equal lengths"),
        ([[make_sample("a", policy_version=-1)]], "policy_version"),
    ],
)
def test_writer_rejects_bad_groups(tmp_path: Path, groups, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_shard_file(tmp_path / "x.h5", groups, "w", 0.0)
    assert not (tmp_path / "x.h5").exists()


def test_a_flipped_payload_byte_in_any_dataset_is_caught_and_named(tmp_path: Path) -> None:
    groups = [[make_full_sample("a0", "ga", 1), make_full_sample("a1", "ga", 2)]]
    pristine = _write(tmp_path / "pristine.h5", groups)
    assert len(dataset_names(pristine)) >= 12  # text, images and audio (five and six)
    missed = datasets_a_flip_goes_unnoticed_in(pristine, tmp_path)
    assert missed == [], "a flipped byte in these datasets was delivered silently"


def test_a_changed_header_attribute_is_caught(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.h5", [make_group("g")])
    with rewritten(path) as h5:
        h5.attrs["created_unix_s"] = 1.0
    with pytest.raises(ShardCorruptError, match="header checksum mismatch"):
        read_shard(path)


def test_a_shard_without_checksums_is_not_trusted(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.h5", [make_group("g")])
    with rewritten(path) as h5:
        del h5.attrs["checksums"]
    with pytest.raises(ShardCorruptError, match="missing attribute 'checksums'"):
        read_shard(path)
    path = _write(tmp_path / "v1.h5", [make_group("g")])
    with rewritten(path, header_checksum=True) as h5:
        h5.attrs["schema_version"] = 1  # the version before checksums
    with pytest.raises(ShardCorruptError, match="schema_version 1 carries no payload checksums"):
        read_shard(path)


def test_newer_schema_version_is_a_clear_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.h5", [make_group("g")])
    with rewritten(path, header_checksum=True) as h5:  # a writer of a newer version
        h5.attrs["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ShardVersionError, match=f"schema_version {SCHEMA_VERSION + 1} is newer"):
        read_shard(path)
    with pytest.raises(ShardVersionError):
        read_header(path)


def _corrupt_truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt_garbage(path: Path) -> None:
    path.write_bytes(b"\x00" * 4096)


def _corrupt_schema_name(path: Path) -> None:
    with rewritten(path) as h5:
        h5.attrs["schema"] = "something.else"


def _corrupt_missing_dataset(path: Path) -> None:
    with rewritten(path) as h5:
        del h5["text"]


def _corrupt_offsets(path: Path) -> None:
    with rewritten(path) as h5:
        blob = h5["text"][()]
        offsets = text_offsets(h5, blob)
        offsets[-2] = offsets[-1] + 5  # the response offsets come last
        h5["text"][...] = blob


def _corrupt_group_count(path: Path) -> None:
    with rewritten(path) as h5:
        h5.attrs["num_groups"] = 5


def _corrupt_dtype(path: Path) -> None:
    with rewritten(path) as h5:
        values = h5["text"][()]
        del h5["text"]
        h5["text"] = values.astype(np.float64)


def _corrupt_json(path: Path) -> None:
    with rewritten(path) as h5:
        h5["text"][text_json_start(h5)] = ord("}")


def _corrupt_json_types(path: Path) -> None:
    with rewritten(path) as h5:
        blob = h5["text"][()]
        start = text_json_start(h5)
        columns = json.loads(blob[start:].tobytes())
        columns["sample_id"] = [1, 2, 3, 4, 5]
        del h5["text"]
        h5["text"] = np.concatenate([blob[:start], json_bytes(columns)])


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_truncated,
        _corrupt_garbage,
        _corrupt_schema_name,
        _corrupt_missing_dataset,
        _corrupt_offsets,
        _corrupt_group_count,
        _corrupt_dtype,
        _corrupt_json,
        _corrupt_json_types,
    ],
)
def test_corrupt_shards_raise_shard_corrupt_error(tmp_path: Path, corrupt) -> None:
    path = _write(tmp_path / "s.h5", [make_group("g1"), make_group("g2", 2)])
    corrupt(path)
    with pytest.raises(ShardCorruptError, match="s.h5"):
        read_shard(path)


def _header_region(data: bytes) -> list[int]:
    """Offsets of the seal and of every HDF5 structure that holds the shard's header: the
    superblock, the root group's object header with its continuation blocks (the attribute
    messages) and the global heap collection holding the attributes' strings."""
    base = SEAL_SIZE  # HDF5 addresses are relative to the superblock, after the user block
    root = base + struct.unpack_from("<Q", data, base + 64)[0]  # v0 superblock: root entry
    size = struct.unpack_from("<I", data, root + 8)[0]  # v1 object header: its size
    # The seal's fields, a sample of the user block's zero padding, then HDF5's structures
    blocks = [(0, 32), *((offset, offset + 1) for offset in range(32, SEAL_SIZE, 53))]
    blocks.append((SEAL_SIZE, root + 16 + size))
    pending = [(root + 16, size)]
    while pending:
        start, size = pending.pop()
        position = start
        while position + 8 <= start + size:
            kind, length = struct.unpack_from("<HH", data, position)
            if kind == 0x10:  # continuation: the attributes that did not fit
                offset, extent = struct.unpack_from("<QQ", data, position + 8)
                blocks.append((base + offset, base + offset + extent))
                pending.append((base + offset, extent))
            position += 8 + length
    heap = data.index(b"GCOL")
    position = heap + 16
    while struct.unpack_from("<H", data, position)[0] != 0:  # object 0: the free space
        object_size = struct.unpack_from("<Q", data, position + 8)[0]
        position += 16 + (object_size + 7) // 8 * 8
    blocks.append((heap, position))
    return sorted({offset for start, end in blocks for offset in range(start, end)})


def test_no_flipped_byte_of_the_header_crashes_the_reader(tmp_path: Path) -> None:
    """Issue #34: a flip in schema_version read as a newer version (a crash loop), and a
    flip in HDF5's attribute metadata crashed libhdf5 itself (a segfault). Each flip of
    each byte now reads correctly or is corrupt (which the reader quarantines)."""
    groups = [make_group("g1"), make_group("g2", 2)]
    pristine = _write(tmp_path / "pristine.h5", groups).read_bytes()
    region = _header_region(pristine)
    assert b"schema_version" in bytes(pristine[i] for i in region)  # the attributes are in it
    assert len(region) > 1000
    path, read, corrupt = tmp_path / "s.h5", 0, 0
    for offset in region:
        for mask in (0x01, 0xFF):
            flipped = bytearray(pristine)
            flipped[offset] ^= mask
            path.write_bytes(flipped)
            try:
                _, got = read_shard(path)
            except ShardCorruptError:
                corrupt += 1
                continue
            read += 1
            assert [[s.sample_id for s in g] for g in got] == [
                [s.sample_id for s in g] for g in groups
            ]
    assert corrupt >= 2 * sum(offset >= SEAL_SIZE for offset in region)  # past the seal
    assert read > 0  # flips in the user block's padding change nothing


def test_a_damaged_version_is_corruption_and_a_genuine_newer_one_is_not(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.h5", [make_group("g")])
    with rewritten(path) as h5:  # the flip: 2 -> 72057594037927938 (bit 56)
        h5.attrs["schema_version"] = SCHEMA_VERSION | 1 << 56
    with pytest.raises(ShardCorruptError, match="header checksum mismatch"):
        read_shard(path)
    with pytest.raises(ShardCorruptError, match="header checksum mismatch"):
        read_header(path)


def test_a_sealed_file_with_a_damaged_magic_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.h5", [make_group("g")])
    data = bytearray(path.read_bytes())
    data[0] ^= 0x20  # the rest of the file is intact and opens
    path.write_bytes(data)
    with pytest.raises(ShardCorruptError, match="seal is damaged"):
        read_shard(path)


def test_a_shard_renamed_between_its_seal_and_the_hdf5_open_is_gone_not_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard claimed after its seal was checked and before libhdf5 opened it moved; it is
    intact: the reader's FileNotFoundError, never a quarantine. (Renamed inside libhdf5's
    open, after its open and before its stat, the library says "can't retrieve stat info";
    ``_open`` maps that to FileNotFoundError too: tests/dist/test_spool_crash.py's observer.)"""
    path = _write(tmp_path / "s.h5", [make_group("g")])
    check_seal = format_module._check_seal

    def check_then_claim(checked: Path) -> bool:
        sealed = check_seal(checked)
        checked.rename(tmp_path / "claimed.h5")  # the consumer's claim, in the window
        return sealed

    monkeypatch.setattr(format_module, "_check_seal", check_then_claim)
    with pytest.raises(FileNotFoundError):
        read_shard(path)
    monkeypatch.undo()
    assert read_shard(tmp_path / "claimed.h5")[0].num_groups == 1
