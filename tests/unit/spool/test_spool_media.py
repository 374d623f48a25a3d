"""A group's media (``Sample.media``) in the shard: stored once per group, read back as one
shared ``MediaPayload``, checksummed like every dataset (a flipped byte quarantines the
shard), exactly-once and resume unchanged, text shards as before."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from spool_factories import make_group

from relax_hpc.media.payload import MediaPayload
from relax_hpc.spool import ShardCorruptError, ShardWriter, SpoolConfig, SpoolReader
from relax_hpc.spool.cli import inspect_lines
from relax_hpc.spool.format import read_shard, seal, write_shard_file
from relax_hpc.spool.layout import SpoolLayout
from relax_hpc.spool.quarantine import list_quarantined

# The datasets of a text shard (schema version 4; earlier ones: test_spool_schema_versions.py).
TEXT_DATASETS = ["text"]
MEDIA_DATASETS = [
    "media/audio/lengths",
    "media/audio/offsets",
    "media/audio/values",
    "media/groups",
    "media/image/offsets",
    "media/image/shapes",
    "media/image/values",
    "media/meta",
]


def payload(seed: int, shapes=((32, 64), (64, 32)), clips=()) -> MediaPayload:
    rng = np.random.default_rng(seed)
    images = tuple(rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in shapes)
    audio = tuple(rng.standard_normal(n).astype(np.float32) for n in clips)
    return MediaPayload(images, audio, sampling_rate_hz=16000, fingerprint=f"fp{seed}")


def media_group(group_id: str, media: MediaPayload | None, size: int = 4) -> list:
    group = make_group(group_id, size)
    for sample in group:
        sample.media = media  # one object for the whole group
    return group


def same_payload(a: MediaPayload, b: MediaPayload) -> bool:
    arrays = zip((*a.images, *a.audio), (*b.images, *b.audio), strict=True)
    return (a.sampling_rate_hz, a.fingerprint) == (b.sampling_rate_hz, b.fingerprint) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in arrays
    )


def dataset_names(path: Path) -> list[str]:
    names: list[str] = []
    with h5py.File(path, "r") as h5:
        h5.visititems(lambda n, obj: names.append(n) if isinstance(obj, h5py.Dataset) else None)
    return sorted(names)


def test_group_media_round_trip_once_per_group_and_shared(tmp_path: Path) -> None:
    first, second = payload(1), payload(2, shapes=((16, 16),), clips=(800, 1200))
    groups = [media_group("a", first), media_group("text", None), media_group("b", second)]
    path = tmp_path / "s.h5"
    write_shard_file(path, groups, "w0", 0.0)
    assert dataset_names(path) == sorted(TEXT_DATASETS + MEDIA_DATASETS)
    with h5py.File(path, "r") as h5:  # each group's pixels once, not once per sample
        assert h5["media/image/values"].size == first.images[0].size * 2 + 16 * 16 * 3
        assert h5["media/groups"][()].tolist() == [0, 2]
    _, read = read_shard(path)
    a, text, b = read
    assert all(s.media is a[0].media for s in a) and all(s.media is b[0].media for s in b)
    assert all(s.media is None for s in text)
    assert same_payload(a[0].media, first) and same_payload(b[0].media, second)
    assert not a[0].media.images[0].flags.writeable


def test_shard_bytes_grow_by_the_images_once_whatever_the_group_size(tmp_path: Path) -> None:
    media = payload(3, shapes=((128, 128),))  # 48 KiB of pixels
    sizes = {}
    for size in (2, 16):
        text, with_media = tmp_path / f"t{size}.h5", tmp_path / f"m{size}.h5"
        write_shard_file(text, [media_group("g", None, size)], "w0", 0.0)
        write_shard_file(with_media, [media_group("g", media, size)], "w0", 0.0)
        sizes[size] = with_media.stat().st_size - text.stat().st_size
    assert media.num_bytes <= sizes[2] < media.num_bytes + 8192
    # 8x the samples, not 8x the images (+336 KiB); HDF5 places metadata in 2 KiB blocks
    assert abs(sizes[16] - sizes[2]) < 4096
    lines = inspect_lines(with_media, limit=1, decode=None)
    expected = f"  group media: 1 groups, 0 samples of their own, {media.num_bytes} bytes"
    assert f"{expected} (once per group or sample)" in lines


def test_text_shards_have_no_media_datasets(tmp_path: Path) -> None:
    path = tmp_path / "s.h5"
    write_shard_file(path, [make_group("a"), make_group("b")], "w0", 0.0)
    assert dataset_names(path) == sorted(TEXT_DATASETS)
    assert all(s.media is None for g in read_shard(path)[1] for s in g)


def test_samples_of_a_multiturn_group_keep_their_own_payloads(tmp_path: Path) -> None:
    """Episodes of one prompt that observed different images: each sample's payload is
    stored once; a sample without media stays without; shared groups beside it as before."""
    shared, own = payload(1), [payload(4, shapes=((16, 16),) * k) for k in (1, 2)]
    group = media_group("agent", None, size=3)
    group[0].media, group[2].media = own
    path = tmp_path / "s.h5"
    write_shard_file(path, [media_group("a", shared), group], "w0", 0.0)
    assert dataset_names(path) == sorted([*TEXT_DATASETS, *MEDIA_DATASETS, "media/samples"])
    with h5py.File(path, "r") as h5:
        assert h5["media/groups"][()].tolist() == [0, 1, 1]
        assert h5["media/samples"][()].tolist() == [-1, 0, 2]
    _, (a, agent) = read_shard(path)
    assert all(s.media is a[0].media for s in a) and same_payload(a[0].media, shared)
    assert same_payload(agent[0].media, own[0]) and same_payload(agent[2].media, own[1])
    assert agent[1].media is None
    lines = inspect_lines(path, limit=0, decode=None)
    assert any("group media: 1 groups, 2 samples of their own" in line for line in lines)


@pytest.mark.parametrize("samples", [[-1, 0, 0], [-1, 3, 0], [-1, 2, 0], [-1, -1, 2]])
def test_bad_media_owners_are_corruption(tmp_path: Path, samples: list[int]) -> None:
    group = media_group("agent", None, size=3)
    group[0].media, group[2].media = payload(4), payload(5)
    path = tmp_path / "s.h5"
    write_shard_file(path, [media_group("a", payload(1)), group], "w0", 0.0)
    with h5py.File(path, "r+") as h5:  # a writer bug, checksummed as written
        checksums = json.loads(h5.attrs["checksums"])
        del h5["media/samples"]
        h5["media/samples"] = np.asarray(samples, dtype=np.int64)
        checksums["media/samples"] = zlib.crc32(np.asarray(samples, dtype=np.int64).tobytes())
        h5.attrs["checksums"] = json.dumps(checksums, sort_keys=True)
    seal(path)
    with pytest.raises(ShardCorruptError, match="name no valid owners"):
        read_shard(path)


def _flip_stored_byte(path: Path, dataset: str) -> None:
    with h5py.File(path, "r") as h5:
        offset, size = h5[dataset].id.get_offset(), h5[dataset].id.get_storage_size()
    with open(path, "r+b") as handle:
        handle.seek(offset + size // 2)
        byte = handle.read(1)
        handle.seek(offset + size // 2)
        handle.write(bytes([byte[0] ^ 0x10]))
    seal(path)  # as if flipped before the seal was written: the dataset's own CRC must catch it


def test_a_flipped_byte_in_any_media_dataset_is_caught(tmp_path: Path) -> None:
    pristine = tmp_path / "pristine.h5"
    groups = [media_group("a", payload(1, clips=(640,))), media_group("b", payload(2))]
    write_shard_file(pristine, groups, "w0", 0.0)
    for dataset in MEDIA_DATASETS:
        path = tmp_path / "s.h5"
        shutil.copyfile(pristine, path)
        _flip_stored_byte(path, dataset)
        with pytest.raises(ShardCorruptError, match=f"checksum mismatch in dataset '{dataset}'"):
            read_shard(path)


def test_a_corrupt_media_shard_is_quarantined_and_training_goes_on(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path, "w0", shard_max_samples=4)
    writer.publish([media_group("good", payload(1))])
    (damaged,) = writer.publish([media_group("lost", payload(2))])
    writer.publish([media_group("later", payload(3))])
    _flip_stored_byte(damaged, "media/image/values")
    reader = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01))
    batch = reader.next_batch(2, policy_version=0, timeout_s=5)
    assert [g[0].group_id for g in batch] == ["good", "later"]
    assert same_payload(batch[1][0].media, payload(3))
    (quarantined,) = list_quarantined(SpoolLayout(tmp_path))
    assert "checksum mismatch in dataset 'media/image/values'" in quarantined.reason


def test_resume_and_duplicates_deliver_each_group_and_its_images_once(tmp_path: Path) -> None:
    media = {name: payload(seed) for seed, name in enumerate("abcd")}
    writer = ShardWriter(tmp_path, "w0", shard_max_samples=8)  # two groups per shard
    writer.publish([media_group(n, media[n]) for n in "abcd"])
    writer.publish([media_group("b", media["b"])])  # a restarted worker's duplicate
    reader = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01))
    assert [g[0].group_id for g in reader.next_batch(1, policy_version=0, timeout_s=1)] == ["a"]
    reader.mark_step_consumed(1)
    checkpoint = reader.state_dict()
    reader.on_checkpoint_complete(1)
    reader.next_batch(2, policy_version=0, timeout_s=1)  # step 2, lost: never checkpointed
    resumed = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01))
    resumed.load_state_dict(checkpoint)
    delivered = resumed.next_batch(3, policy_version=0, timeout_s=1)
    assert [g[0].group_id for g in delivered] == ["b", "c", "d"]
    for group in delivered:
        assert same_payload(group[0].media, media[group[0].group_id])
