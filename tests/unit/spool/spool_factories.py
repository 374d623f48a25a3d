"""Sample and group builders shared by the spool unit tests."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np

from relax_hpc.spool import AudioClip, Sample, ShardCorruptError
from relax_hpc.spool.columns import packed_offsets_count, text_sections
from relax_hpc.spool.format import (
    CHECKSUMS_ATTR,
    HEADER_CHECKSUM_KEY,
    _header_checksum,
    _header_fields,
    read_shard,
    seal,
)


def make_sample(
    sample_id: str,
    group_id: str = "g0",
    policy_version: int = 0,
    num_response: int = 7,
    seed: int = 0,
    **fields,
) -> Sample:
    rng = np.random.default_rng(seed)
    values = dict(
        sample_id=sample_id,
        group_id=group_id,
        data_index=3,
        prompt_token_ids=rng.integers(0, 50_000, 5, dtype=np.int32),
        response_token_ids=rng.integers(0, 50_000, num_response, dtype=np.int32),
        loss_mask=np.ones(num_response, np.uint8),
        rollout_logprobs=-rng.random(num_response).astype(np.float32),
        reward=1.0,
        policy_version=policy_version,
        finish_reason="stop",
    )
    values.update(fields)
    return Sample(**values)


def make_group(group_id: str, size: int = 3, policy_version: int = 0) -> list[Sample]:
    return [
        make_sample(
            f"{group_id}-s{k}",
            group_id,
            policy_version,
            seed=zlib.crc32(f"{group_id}-{k}".encode()),
        )
        for k in range(size)
    ]


def make_full_sample(sample_id: str, group_id: str, seed: int) -> Sample:
    """Every field populated, multimodal payloads included, odd lengths and unicode."""
    rng = np.random.default_rng(seed)
    mask = np.array([1, 1, 0, 0, 0, 1, 1, 1], np.uint8)  # observation tokens in the middle
    return make_sample(
        sample_id,
        group_id,
        policy_version=7,
        num_response=len(mask),
        seed=seed,
        loss_mask=mask,
        data_index=123_456_789_012,
        reward=-0.25,
        finish_reason="length",
        num_turns=3,
        reward_details={"correct": 0.0, "format": 0.5, "answer": "42 ✓"},
        timings_s={"generate": 1.5, "reward": 0.01},
        images=[
            rng.integers(0, 256, (6, 5, 3), dtype=np.uint8),
            rng.integers(0, 256, (4, 2), dtype=np.uint8),
        ],
        audio=[
            AudioClip(rng.standard_normal(11).astype(np.float32), 16_000),
            AudioClip(rng.standard_normal((9, 2)).astype(np.float32), 44_100),
        ],
        metadata={"dataset": "gsm8k", "tools": ["python"], "note": "ünïcödé"},
    )


def assert_samples_equal(actual: Sample, expected: Sample) -> None:
    for field in dataclasses.fields(Sample):
        a, e = getattr(actual, field.name), getattr(expected, field.name)
        if isinstance(e, np.ndarray):
            assert a.dtype == e.dtype or field.name == "loss_mask", field.name
            np.testing.assert_array_equal(a, e, err_msg=field.name)
        elif field.name == "images":
            assert len(a) == len(e)
            for x, y in zip(a, e, strict=True):
                assert x.dtype == np.uint8 and x.shape == y.shape
                np.testing.assert_array_equal(x, y)
        elif field.name == "audio":
            assert [c.sample_rate_hz for c in a] == [c.sample_rate_hz for c in e]
            for x, y in zip(a, e, strict=True):
                assert x.waveform.dtype == np.float32 and x.waveform.shape == y.waveform.shape
                np.testing.assert_array_equal(x.waveform, y.waveform)
        elif field.name == "media":
            assert (a is None) == (e is None), field.name
            if e is not None:
                assert (a.sampling_rate_hz, a.fingerprint) == (e.sampling_rate_hz, e.fingerprint)
                for x, y in zip((*a.images, *a.audio), (*e.images, *e.audio), strict=True):
                    assert x.dtype == y.dtype
                    np.testing.assert_array_equal(x, y)
        else:
            assert a == e, field.name


@contextlib.contextmanager
def rewritten(path: Path, header_checksum: bool = False) -> Iterator[h5py.File]:
    """Open a shard to change it on purpose, then seal it again, so that a test reaches the
    checks behind the seal. ``header_checksum``: also store the header's new checksum, as a
    writer of that header would have (a genuine header, not a damaged one)."""
    with h5py.File(path, "r+") as h5:
        yield h5
        if header_checksum:
            header = _header_fields(h5, path.name)
            checksums = json.loads(h5.attrs[CHECKSUMS_ATTR])
            checksums[HEADER_CHECKSUM_KEY] = _header_checksum(header)
            h5.attrs[CHECKSUMS_ATTR] = json.dumps(checksums, sort_keys=True)
    seal(path)


def dataset_names(path: Path) -> list[str]:
    """Every HDF5 dataset of the shard at ``path``, sorted."""
    names: list[str] = []
    with h5py.File(path, "r") as h5:
        h5.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
    return sorted(names)


def flip_stored_byte(path: Path, dataset: str) -> None:
    """Flip one bit of ``dataset``'s stored bytes in the file itself (not through HDF5),
    then seal the file again: as if flipped before the seal, so only the dataset's own CRC
    can catch it."""
    with h5py.File(path, "r") as h5:
        offset = h5[dataset].id.get_offset()
        size = h5[dataset].id.get_storage_size()
    assert offset is not None and size > 0, dataset
    with open(path, "r+b") as handle:
        handle.seek(offset + size // 2)
        byte = handle.read(1)
        handle.seek(offset + size // 2)
        handle.write(bytes([byte[0] ^ 0x10]))
    seal(path)


def datasets_a_flip_goes_unnoticed_in(pristine: Path, scratch: Path) -> list[str]:
    """The datasets of ``pristine`` whose flipped byte ``read_shard`` delivers silently
    (a copy per dataset in ``scratch``); each caught flip must name its dataset."""
    missed = []
    for dataset in dataset_names(pristine):
        path = scratch / "flipped.h5"
        shutil.copyfile(pristine, path)
        flip_stored_byte(path, dataset)
        try:
            read_shard(path)
            missed.append(dataset)
        except ShardCorruptError as error:
            assert f"checksum mismatch in dataset '{dataset}'" in str(error)
    return missed


# --- version 4's ``text`` blob (spool/columns.py's ``text_sections``) ---------------------------
def json_bytes(value) -> np.ndarray:
    return np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)


def text_offsets(h5: h5py.File, blob: np.ndarray) -> np.ndarray:
    """The packed offsets at the head of ``blob`` (the shard's ``text``): a writable view."""
    g, n = int(h5.attrs["num_groups"]), int(h5.attrs["num_samples"])
    return blob[: packed_offsets_count(g, n) * 8].view("<i8")


def text_json_start(h5: h5py.File) -> int:
    """Where the JSON columns begin in the shard's ``text``."""
    offsets = text_offsets(h5, h5["text"][()])
    g, n = int(h5.attrs["num_groups"]), int(h5.attrs["num_samples"])
    return text_sections(g, n, int(offsets[g + 1 + n]), int(offsets[-1]))[1]
