"""Schema versions: writers write version 4 only; the reader reads version 2 and 3 shards
(written by relax_hpc before version 3 and 4, ``tests/data/spool/shard_v2.h5`` and
``shard_v3.h5``) field for field, as strictly as before, so a run started before an upgrade
resumes after it; a newer version is refused with the same message as always."""

from __future__ import annotations

import dataclasses
import json
import shutil
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from spool_factories import (
    assert_samples_equal,
    dataset_names,
    datasets_a_flip_goes_unnoticed_in,
    json_bytes,
    make_full_sample,
    make_group,
    rewritten,
    text_json_start,
    text_offsets,
)
from spool_v2_fixture import (
    V2_CREATED_UNIX_S,
    V2_SHARD_PATH,
    V2_WRITER_ID,
    V3_CREATED_UNIX_S,
    V3_SHARD_PATH,
    V3_WRITER_ID,
    v2_fixture_groups,
)

from relax_hpc.spool import (
    ShardCorruptError,
    ShardVersionError,
    ShardWriter,
    SpoolConfig,
    SpoolReader,
)
from relax_hpc.spool.format import (
    CHECKSUMS_ATTR,
    MIN_SCHEMA_VERSION,
    SCHEMA_VERSION,
    read_header,
    read_shard,
    write_shard_file,
)
from relax_hpc.spool.layout import SpoolLayout

V2_TEXT_DATASETS = [
    "groups/offsets",
    "prompt/offsets",
    "prompt/token_ids",
    "response/loss_mask",
    "response/offsets",
    "response/rollout_logprobs",
    "response/token_ids",
    *(
        f"sample/{c}"
        for c in (
            "data_index",
            "finish_reason",
            "group_id",
            "metadata",
            "num_turns",
            "policy_version",
            "reward",
            "reward_details",
            "sample_id",
            "timings_s",
        )
    ),
]


V3_TEXT_DATASETS = [
    "offsets",
    "prompt/token_ids",
    "response/loss_mask",
    "response/rollout_logprobs",
    "response/token_ids",
    "sample/json",
    "sample/scalars",
]


def _copy(source: Path, tmp_path: Path, name: str = "s.h5") -> Path:
    path = tmp_path / name
    shutil.copyfile(source, path)
    path.chmod(0o644)
    return path


def _v2_copy(tmp_path: Path, name: str = "s.h5") -> Path:
    return _copy(V2_SHARD_PATH, tmp_path, name)


def _shard_of(source: str, tmp_path: Path, name: str = "s.h5") -> Path:
    """The fixture groups as a shard of version ``source`` ("v2", "v3": the old writers'
    files; "v4": written now)."""
    if source == "v2":
        return _v2_copy(tmp_path, name)
    if source == "v3":
        return _copy(V3_SHARD_PATH, tmp_path, name)
    path = tmp_path / name
    write_shard_file(path, v2_fixture_groups(), V2_WRITER_ID, V2_CREATED_UNIX_S)
    return path


def _assert_groups_equal(got: list, want: list) -> None:
    assert [len(g) for g in got] == [len(g) for g in want]
    for a, e in zip([s for g in got for s in g], [s for g in want for s in g], strict=True):
        assert_samples_equal(a, e)


def test_writers_write_version_4_and_readers_accept_2_to_4() -> None:
    assert (MIN_SCHEMA_VERSION, SCHEMA_VERSION) == (2, 4)


# version -> the old writer's shard of the fixture groups, its text datasets, writer, time
FIXTURES = {
    2: (V2_SHARD_PATH, V2_TEXT_DATASETS, V2_WRITER_ID, V2_CREATED_UNIX_S),
    3: (V3_SHARD_PATH, V3_TEXT_DATASETS, V3_WRITER_ID, V3_CREATED_UNIX_S),
}


@pytest.mark.parametrize("version", sorted(FIXTURES))
def test_each_fixture_is_a_shard_of_its_version_with_every_kind_of_field(version: int) -> None:
    path, text_datasets, _, _ = FIXTURES[version]
    assert read_header(path).schema_version == version
    names = dataset_names(path)
    assert set(text_datasets) <= set(names)
    assert {"images/values", "audio/sample_rate_hz", "media/groups", "media/samples"} <= set(names)


@pytest.mark.parametrize("version", sorted(FIXTURES))
def test_each_fixture_reads_back_every_field_equal(version: int) -> None:
    path, _, writer_id, created_unix_s = FIXTURES[version]
    header, got = read_shard(path)
    assert (header.schema_version, header.writer_id) == (version, writer_id)
    assert header.created_unix_s == created_unix_s
    assert (header.num_groups, header.num_samples) == (4, 10)
    assert (header.min_policy_version, header.max_policy_version) == (5, 7)
    _assert_groups_equal(got, v2_fixture_groups())
    full, text, shared, own = got
    assert all(s.media is shared[0].media for s in shared)  # one object per group, as written
    assert [s.media is None for s in own] == [False, True, False]
    assert not full[0].response_token_ids.flags.writeable


def test_a_version_4_shard_of_the_same_groups_reads_back_the_same(tmp_path: Path) -> None:
    path = _shard_of("v4", tmp_path, "v4.h5")
    header, got = read_shard(path)
    v2_header, v2_got = read_shard(V2_SHARD_PATH)
    assert header == dataclasses.replace(v2_header, schema_version=4)
    _assert_groups_equal(got, v2_got)
    names = dataset_names(path)
    assert "text" in names and not set(V3_TEXT_DATASETS) & set(names)
    assert len(names) == len(dataset_names(V3_SHARD_PATH)) - 6
    assert not got[0][0].response_token_ids.flags.writeable


@pytest.mark.parametrize("source", ["v2", "v3"])
def test_a_spool_holding_older_shards_resumes_after_the_upgrade(
    tmp_path: Path, source: str
) -> None:
    """ready/ holds a shard an old writer published; the upgraded writer publishes after it;
    the upgraded reader delivers both, in publish order, every field as written."""
    writer = ShardWriter(tmp_path, "rollout.v4")
    old_name = f"1765000000500-rollout.{source}-000000-0a1b2c3d-v5-g4-s10.h5"
    _copy(
        V2_SHARD_PATH if source == "v2" else V3_SHARD_PATH,
        SpoolLayout(tmp_path).ready_dir,
        old_name,
    )
    after = [make_group("after", 2, policy_version=8)]
    writer.publish(after)
    reader = SpoolReader(tmp_path, SpoolConfig(poll_s=0.01))
    got = reader.next_batch(5, policy_version=8, timeout_s=60)
    _assert_groups_equal(got, [*v2_fixture_groups(), *after])


@pytest.mark.parametrize("source", ["v2", "v3", "v4"])
def test_a_flipped_byte_in_any_dataset_of_every_version_is_named(
    tmp_path: Path, source: str
) -> None:
    pristine = _shard_of(source, tmp_path, "pristine.h5")
    missed = datasets_a_flip_goes_unnoticed_in(pristine, tmp_path)
    assert missed == []


def _replace(h5: h5py.File, name: str, values: np.ndarray) -> None:
    """Replace a dataset and store its new checksum, as a buggy writer would have: only the
    reader's structural checks stand between it and the trainer."""
    del h5[name]
    h5[name] = values
    checksums = json.loads(h5.attrs[CHECKSUMS_ATTR])
    checksums[name] = zlib.crc32(np.ascontiguousarray(values))
    h5.attrs[CHECKSUMS_ATTR] = json.dumps(checksums, sort_keys=True)


def _v2_missing_dataset(h5: h5py.File) -> str:
    del h5["response/loss_mask"]
    return "missing dataset 'response/loss_mask'"


def _v2_offsets(h5: h5py.File) -> str:
    offsets = h5["response/offsets"][()]
    offsets[1] = offsets[-1] + 5
    _replace(h5, "response/offsets", offsets)
    return "offsets 'response/offsets' do not partition"


def _v2_dtype(h5: h5py.File) -> str:
    _replace(h5, "prompt/token_ids", h5["prompt/token_ids"][()].astype(np.float64))
    return "dataset 'prompt/token_ids' has dtype float64"


def _v2_json(h5: h5py.File) -> str:
    _replace(h5, "sample/metadata", np.frombuffer(b"}{", dtype=np.uint8))
    return "column 'sample/metadata' is not utf-8 JSON"


def _v2_json_types(h5: h5py.File) -> str:
    _replace(h5, "sample/sample_id", json_bytes(list(range(10))))
    return "column 'sample/sample_id' holds values that are not str"


def _v3_offsets(h5: h5py.File) -> str:
    offsets = h5["offsets"][()]
    offsets[-2] = offsets[-1] + 5
    _replace(h5, "offsets", offsets)
    return "offsets 'offsets' \\(response\\) do not partition"


def _v3_scalars_dtype(h5: h5py.File) -> str:
    scalars = h5["sample/scalars"][()]
    wrong = np.dtype([(n, np.int64) for n in scalars.dtype.names])
    _replace(h5, "sample/scalars", scalars.astype(wrong))
    return "dataset 'sample/scalars' has dtype"


def _v3_json(h5: h5py.File) -> str:
    _replace(h5, "sample/json", np.frombuffer(b"\xff{", dtype=np.uint8))
    return "'sample/json' is not utf-8 JSON"


def _v3_json_columns(h5: h5py.File) -> str:
    columns = json.loads(h5["sample/json"][()].tobytes())
    del columns["metadata"]
    _replace(h5, "sample/json", json_bytes(columns))
    return "'sample/json' is not an object of the columns"


def _v3_json_types(h5: h5py.File) -> str:
    columns = json.loads(h5["sample/json"][()].tobytes())
    columns["sample_id"] = list(range(len(columns["sample_id"])))
    _replace(h5, "sample/json", json_bytes(columns))
    return "column 'sample_id' of 'sample/json' holds values that are not str"


def _v3_json_length(h5: h5py.File) -> str:
    columns = json.loads(h5["sample/json"][()].tobytes())
    columns["group_id"] = columns["group_id"][:-1]
    _replace(h5, "sample/json", json_bytes(columns))
    return "column 'group_id' of 'sample/json' is not a list of 10 values"


def _replace_text(h5: h5py.File, blob: np.ndarray) -> None:
    _replace(h5, "text", blob)


def _v4_missing_text(h5: h5py.File) -> str:
    del h5["text"]
    return "missing dataset 'text'"


def _v4_dtype(h5: h5py.File) -> str:
    _replace(h5, "text", h5["text"][()].astype(np.int32))
    return "dataset 'text' has dtype int32"


def _v4_offsets(h5: h5py.File) -> str:
    blob = h5["text"][()]
    offsets = text_offsets(h5, blob)
    offsets[-2] = offsets[-1] + 5
    _replace_text(h5, blob)
    return "offsets 'text' \\(response\\) do not partition"


def _v4_too_short_for_offsets(h5: h5py.File) -> str:
    _replace_text(h5, h5["text"][()][:40])
    return "'text' holds 40 bytes, fewer than its offsets"


def _v4_tokens_past_the_end(h5: h5py.File) -> str:
    blob = h5["text"][()]
    offsets = text_offsets(h5, blob)
    offsets[-1] += 1_000_000  # the response offsets still partition, into bytes not there
    _replace_text(h5, blob)
    return "'text' ends inside its 'response/token_ids' section"


def _v4_json(h5: h5py.File) -> str:
    blob = h5["text"][()]
    blob[text_json_start(h5)] = 0xFF
    _replace_text(h5, blob)
    return "'text' is not utf-8 JSON"


def _v4_json_columns(h5: h5py.File) -> str:
    blob, start = h5["text"][()], text_json_start(h5)
    columns = json.loads(blob[start:].tobytes())
    del columns["metadata"]
    _replace_text(h5, np.concatenate([blob[:start], json_bytes(columns)]))
    return "'text' is not an object of the columns"


def _v4_json_length(h5: h5py.File) -> str:
    blob, start = h5["text"][()], text_json_start(h5)
    columns = json.loads(blob[start:].tobytes())
    columns["group_id"] = columns["group_id"][:-1]
    _replace_text(h5, np.concatenate([blob[:start], json_bytes(columns)]))
    return "column 'group_id' of 'text' is not a list of 10 values"


@pytest.mark.parametrize(
    "corrupt",
    [
        _v2_missing_dataset,
        _v2_offsets,
        _v2_dtype,
        _v2_json,
        _v2_json_types,
        _v3_offsets,
        _v3_scalars_dtype,
        _v3_json,
        _v3_json_columns,
        _v3_json_types,
        _v3_json_length,
        _v4_missing_text,
        _v4_dtype,
        _v4_offsets,
        _v4_too_short_for_offsets,
        _v4_tokens_past_the_end,
        _v4_json,
        _v4_json_columns,
        _v4_json_length,
    ],
)
def test_structural_damage_behind_valid_checksums_is_refused(tmp_path: Path, corrupt) -> None:
    path = _shard_of(corrupt.__name__[1:3], tmp_path)
    with rewritten(path) as h5:
        message = corrupt(h5)
    with pytest.raises(ShardCorruptError, match=f"s.h5: .*{message}"):
        read_shard(path)


@pytest.mark.parametrize("source", ["v2", "v3", "v4"])
def test_a_header_above_the_schema_version_is_refused_as_before(
    tmp_path: Path, source: str
) -> None:
    path = _shard_of(source, tmp_path)
    with rewritten(path, header_checksum=True) as h5:  # a writer of a newer version
        h5.attrs["schema_version"] = SCHEMA_VERSION + 1
    message = (
        f"s.h5: shard schema_version {SCHEMA_VERSION + 1} is newer than this code reads "
        f"(<= {SCHEMA_VERSION}); run the same relax_hpc version on trainer and rollout"
    )
    for read in (read_shard, read_header):
        with pytest.raises(ShardVersionError) as caught:
            read(path)
        assert str(caught.value) == message


def test_every_field_of_full_samples_round_trips_in_version_4(tmp_path: Path) -> None:
    groups = [[make_full_sample(f"f{k}", "f", seed=k) for k in range(3)], make_group("t", 2)]
    path = tmp_path / "s.h5"
    write_shard_file(path, groups, "w0", 0.0)
    _, got = read_shard(path)
    _assert_groups_equal(got, groups)
