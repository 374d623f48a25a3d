"""The HDF5 shard format: encode groups of samples to bytes, decode and validate them.

Layout (schema version 4; versions 2 and 3 below). File attributes: ``schema`` (=
``SCHEMA_NAME``), ``schema_version``, ``writer_id``, ``created_unix_s``, ``num_groups``,
``num_samples``, ``min_policy_version``, ``max_policy_version``, ``checksums`` (see below).
Datasets, all 1-D unless noted (G groups, N samples, P prompt and R response tokens):

    text                        uint8: every per-sample text column, in sections that each
                                start at a multiple of 8 bytes (``columns.text_sections``):
        offsets                 int64 (G+1 + 2(N+1),)  three offsets arrays end to end: groups
                                (samples of group g are [o[g], o[g+1])), then prompt tokens,
                                then response tokens of each sample (P and R: their ends)
        scalars                 compound (N,): data_index, policy_version, num_turns (int64),
                                reward (float64), little-endian, one record per sample
        prompt/token_ids        int32 (P,), cut by the prompt offsets
        response/token_ids, response/loss_mask, response/rollout_logprobs
                                int32 / uint8 / float32 (R,), cut by the response offsets
        json                    to the end: the utf-8 JSON object {column: [N values]} of
                                sample_id, group_id, finish_reason (strings), reward_details,
                                timings_s, metadata (objects): one encode/decode per shard
    images/values, images/value_offsets, images/shapes, images/shape_offsets,
    images/sample_offsets       a list of uint8 arrays: flat values, per-array offsets,
                                concatenated shapes, and which arrays belong to which sample
    audio/... (same five) + audio/sample_rate_hz   float32 waveforms and int64 rates
                                (``images``/``audio`` only when some sample has them)
    media/...                   the fitted media (``Sample.media``), ONCE PER GROUP when
                                every sample of the group shares one ``MediaPayload`` (the
                                prompt's), else once per sample (a multi-turn group whose
                                episodes observed different images); only when some sample
                                has media, see "Media" below

Media (``MediaPayload.to_arrays`` of each of the M stored payloads, concatenated):

    media/groups                int64 (M,)    the group of each payload, non-decreasing
    media/samples               int64 (M,)    only when some group stores per sample: the
                                              sample's index in its group, or -1 for the
                                              whole group; (group, sample) increasing
    media/meta                  uint8         utf-8 JSON array of M ``{sampling_rate_hz,
                                              fingerprint}``
    media/image/values          uint8         every image's (H, W, 3) pixels, flat
    media/image/shapes          int64 (3I,)   (H, W, 3) of each image
    media/image/offsets         int64 (M+1,)  images of media group m: [offsets[m], offsets[m+1])
    media/audio/values          float32       every clip, flat
    media/audio/lengths         int64 (C,)    samples of each clip
    media/audio/offsets         int64 (M+1,)  clips of media group m

Version 3 (written before version 4; still read, never written) has the same attributes,
``images``/``audio``/``media`` datasets and checksums, and the sections of ``text`` as seven
datasets of their own: ``offsets``, ``sample/scalars``, ``sample/json``,
``prompt/token_ids`` and the three ``response/`` arrays. Version 2 (before version 3) has
one dataset per column and per offsets array instead: ``groups/offsets`` (G+1,),
``sample/<column>`` for each scalar column (its dtype) and each JSON column (a JSON array of
N values), ``prompt/offsets`` and ``response/offsets`` (N+1,): 17 datasets for a text shard.
h5py costs ~0.1 ms of CPU per dataset to create and as much to read (~0.3 ms in a running
trainer, whose caches its step has just filled), more than a small shard's bytes: one
dataset instead of seven halved a 128-sample shard's write and read
(``benchmarks/shard_io.py``). ``columns.TEXT_READERS`` decodes each version.

The reader builds one ``MediaPayload`` per stored payload and gives a group's to every
sample of the group (shared, as written). A shard without per-sample payloads has no
``media/samples`` (the layout of shards written before it); a reader without per-sample
support finds an undecoded dataset and refuses such a shard as corrupt, never misreads it.
Shards without media (text) have no ``media/`` datasets. (Media came within version 2: a
reader of version 2 without media support finds datasets it did not decode and refuses the
shard as corrupt; it never misreads one.)

Seal: the file begins with a 512-byte HDF5 user block (never read by the library) holding
``SEAL_MAGIC``, the number of bytes after it and their CRC-32. The reader checks it before
libhdf5 parses the file, because a flipped byte in HDF5's own metadata can crash the
library rather than raise (a segfault reading an attribute, found by flipping every byte
of the header region). A file without the seal (written before it) is read as before; a
sealed file whose magic is damaged is recognised by its user block and refused.

Integrity: ``checksums`` is a JSON object mapping every dataset's name to the zlib CRC-32
of its bytes, and ``header`` to the CRC-32 of the header attributes (canonical JSON). The
reader checks every dataset it decodes against it, and that it decodes exactly the
datasets listed, before it returns any group: a flipped bit anywhere in the stored
samples or the header makes the whole shard ``ShardCorruptError`` (the reader quarantines
it), never a silently different sample. CRC-32 detects every burst error up to 32 bits
and any other change with probability 1 - 2**-32; it is not a MAC (see SECURITY.md).
Cost: ~1.8 GB/s per core, measured in ``benchmarks/spool_throughput.py``.

Concatenated arrays with offsets (no per-sample datasets) keep a shard to 1 dataset (text)
to 21 (images, audio and media), so encoding is a few large memcpys and decoding yields
zero-copy views. No compression:
token ids and pixels compress poorly and the spool's budget is bandwidth, not disk.

A reader accepts versions ``MIN_SCHEMA_VERSION``..``SCHEMA_VERSION``. The header is
trusted only when its checksum holds, so the version is judged after it: a flipped byte in
``schema_version`` (or any header attribute) is corruption like any other, and only a
version above ``SCHEMA_VERSION`` in a header whose checksum holds raises
``ShardVersionError`` (the reading code is too old; the trainer stops once, as a
configuration error). Newer schema versions must therefore keep ``checksums["header"]``
as the CRC-32 of these seven fields (they may add attributes beside them). Version 1 had
no checksums and is refused as corrupt: a shard that cannot be verified is not trusted.
Anything else malformed raises ``ShardCorruptError``. Must not: touch the spool's directories (see ``layout``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from relax_hpc.media.payload import MediaPayload
from relax_hpc.spool import hdf5
from relax_hpc.spool.columns import (
    JSON_COLUMNS,
    SCALAR_COLUMNS,
    SCALARS_DTYPE,
    TEXT_READERS,
    Columns,
    json_list,
    text_sections,
)
from relax_hpc.spool.errors import ShardCorruptError, ShardVersionError
from relax_hpc.spool.sample import AudioClip, Group, Sample

SCHEMA_NAME = "relax_hpc.spool.shard"
SCHEMA_VERSION = 4
MIN_SCHEMA_VERSION = 2  # the first version with checksums
CHECKSUMS_ATTR = "checksums"
HEADER_CHECKSUM_KEY = "header"
# The seal: the file's first bytes (HDF5's user block, which the library never reads) hold
# the CRC-32 of everything after them, checked before libhdf5 parses a byte of it.
SEAL_SIZE = 512  # the smallest HDF5 user block
SEAL_MAGIC = b"relax_hpc.seal/1"
_SEAL = struct.Struct("<16sQI")  # magic, bytes after the user block, their CRC-32
_CRC_CHUNK = 1 << 22


_SAMPLE_FIELDS = tuple(field.name for field in dataclasses.fields(Sample))


@dataclass(frozen=True)
class ShardHeader:
    """The file attributes of a shard: cheap to read, enough for listings."""

    schema_version: int
    writer_id: str
    created_unix_s: float
    num_groups: int
    num_samples: int
    min_policy_version: int
    max_policy_version: int


# --- encoding ------------------------------------------------------------------------------------
def _offsets(lengths: Sequence[int]) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _concat(arrays: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    if not arrays:
        return np.zeros(0, dtype=dtype)
    return np.concatenate([np.asarray(a, dtype=dtype).reshape(-1) for a in arrays])


class _ChecksummedDatasets:
    """``h5[name] = values`` for a new shard, remembering the CRC-32 of each dataset's bytes."""

    def __init__(self, fid: h5py.h5f.FileID) -> None:
        self._fid = fid
        self.checksums: dict[str, int] = {}

    def __setitem__(self, name: str, values: np.ndarray) -> None:
        array = np.ascontiguousarray(values)
        hdf5.put_dataset(self._fid, name, array)
        self.checksums[name] = zlib.crc32(array)


def _header_checksum(header: ShardHeader) -> int:
    return zlib.crc32(json.dumps(dataclasses.asdict(header), sort_keys=True).encode("utf-8"))


def _put_array_list(
    h5: _ChecksummedDatasets, name: str, per_sample: Sequence[Sequence], dtype: type
) -> None:
    arrays = [np.asarray(a, dtype=dtype) for sample in per_sample for a in sample]
    h5[f"{name}/values"] = _concat(arrays, dtype)
    h5[f"{name}/value_offsets"] = _offsets([a.size for a in arrays])
    h5[f"{name}/shapes"] = _concat([np.asarray(a.shape, np.int64) for a in arrays], np.int64)
    h5[f"{name}/shape_offsets"] = _offsets([a.ndim for a in arrays])
    h5[f"{name}/sample_offsets"] = _offsets([len(sample) for sample in per_sample])


def _check_group(group: Sequence[Sample], index: int) -> None:
    if not group:
        raise ValueError(f"group {index} is empty; a shard holds whole, non-empty groups")
    group_ids = {s.group_id for s in group}
    if len(group_ids) != 1:
        raise ValueError(f"group {index} mixes group ids {sorted(group_ids)}")
    for s in group:
        num_response = len(s.response_token_ids)
        if len(s.loss_mask) != num_response or len(s.rollout_logprobs) != num_response:
            raise ValueError(
                f"sample {s.sample_id!r}: response_token_ids, loss_mask and rollout_logprobs "
                f"must have equal lengths, got {num_response}, {len(s.loss_mask)}, "
                f"{len(s.rollout_logprobs)}"
            )
        if s.policy_version < 0:
            raise ValueError(f"sample {s.sample_id!r}: policy_version must be >= 0")


def _scalars_of(sample: Sample) -> tuple:
    return tuple(getattr(sample, c) for c in SCALAR_COLUMNS)


def _text_blob(groups: Sequence[Sequence[Sample]], samples: list[Sample]) -> np.ndarray:
    """Version 4's ``text`` dataset: the sections of ``columns.text_sections``, each at a
    multiple of 8 bytes, then the JSON columns (the module docstring)."""
    prompt_offsets = _offsets([len(s.prompt_token_ids) for s in samples])
    response_offsets = _offsets([len(s.response_token_ids) for s in samples])
    values = {
        "offsets": [_offsets([len(g) for g in groups]), prompt_offsets, response_offsets],
        "scalars": [np.array([_scalars_of(s) for s in samples], dtype=SCALARS_DTYPE)],
        "prompt/token_ids": [s.prompt_token_ids for s in samples],
        "response/token_ids": [s.response_token_ids for s in samples],
        "response/loss_mask": [s.loss_mask for s in samples],
        "response/rollout_logprobs": [s.rollout_logprobs for s in samples],
    }
    columns = {c: [getattr(s, c) for s in samples] for c in JSON_COLUMNS}
    text = json.dumps(columns, sort_keys=True).encode("utf-8")
    sections, json_start = text_sections(
        len(groups), len(samples), int(prompt_offsets[-1]), int(response_offsets[-1])
    )
    blob = np.zeros(json_start + len(text), dtype=np.uint8)
    for name, dtype, start, end in sections:
        if end > start:  # each array's values end to end, cast as np.asarray(a, dtype) would
            flat = [np.asarray(a).reshape(-1) for a in values[name]]
            np.concatenate(flat, out=blob[start:end].view(dtype), casting="unsafe")
    blob[json_start:] = np.frombuffer(text, dtype=np.uint8)
    return blob


def _write_samples(
    h5: _ChecksummedDatasets, groups: Sequence[Sequence[Sample]], samples: list[Sample]
) -> None:
    """The version-4 sample datasets (the module docstring): ``text`` alone for a text
    shard, because each dataset costs h5py ~0.1 ms to create and as much to read (~0.3 ms
    in a running trainer), more than its bytes at these sizes."""
    h5["text"] = _text_blob(groups, samples)
    if any(s.images for s in samples):
        _put_array_list(h5, "images", [s.images for s in samples], np.uint8)
    if any(s.audio for s in samples):
        _put_array_list(h5, "audio", [[c.waveform for c in s.audio] for s in samples], np.float32)
        rates = [c.sample_rate_hz for s in samples for c in s.audio]
        h5["audio/sample_rate_hz"] = np.asarray(rates, dtype=np.int64)


def _media_entries(groups: Sequence[Sequence[Sample]]) -> list[tuple[int, int, MediaPayload]]:
    """(group, sample or -1 for the whole group, payload) of every payload to store."""
    entries = []
    for g, group in enumerate(groups):
        if all(s.media is group[0].media for s in group):
            if group[0].media is not None:
                entries.append((g, -1, group[0].media))
        else:
            entries += [(g, j, s.media) for j, s in enumerate(group) if s.media is not None]
    return entries


def _write_group_media(h5: _ChecksummedDatasets, groups: Sequence[Sequence[Sample]]) -> None:
    """The ``media/`` datasets: each group's payload once, or each sample's (see the module
    docstring)."""
    entries = _media_entries(groups)
    if not entries:
        return
    stored = [payload.to_arrays() for _, _, payload in entries]
    h5["media/groups"] = np.asarray([g for g, _, _ in entries], dtype=np.int64)
    if any(j >= 0 for _, j, _ in entries):
        h5["media/samples"] = np.asarray([j for _, j, _ in entries], dtype=np.int64)
    metas = json.dumps([meta for _, meta in stored], sort_keys=True).encode("utf-8")
    h5["media/meta"] = np.frombuffer(metas, dtype=np.uint8)
    arrays = [a for a, _ in stored]
    h5["media/image/values"] = _concat([a["image/values"] for a in arrays], np.uint8)
    h5["media/image/shapes"] = _concat([a["image/shapes"] for a in arrays], np.int64)
    h5["media/image/offsets"] = _offsets([len(a["image/shapes"]) for a in arrays])
    h5["media/audio/values"] = _concat([a["audio/values"] for a in arrays], np.float32)
    h5["media/audio/lengths"] = _concat([a["audio/lengths"] for a in arrays], np.int64)
    h5["media/audio/offsets"] = _offsets([len(a["audio/lengths"]) for a in arrays])


def write_shard_file(
    path: Path, groups: Sequence[Sequence[Sample]], writer_id: str, created_unix_s: float
) -> ShardHeader:
    """Write ``groups`` as a new shard file at ``path`` (no fsync; the writer owns durability).

    HDF5 writes each concatenated array straight from its buffer into the file, one copy
    fewer than building an in-memory file image first (measured: ~1.5x faster publishing),
    through h5py's low-level API (``spool.hdf5``: ~2/3 of the high-level API's CPU).
    Raises ValueError on bad input, before creating the file.
    """
    if not groups:
        raise ValueError("a shard needs at least one group")
    for index, group in enumerate(groups):
        _check_group(group, index)
    samples = [s for group in groups for s in group]
    versions = [s.policy_version for s in samples]
    header = ShardHeader(
        schema_version=SCHEMA_VERSION,
        writer_id=writer_id,
        created_unix_s=float(created_unix_s),
        num_groups=len(groups),
        num_samples=len(samples),
        min_policy_version=min(versions),
        max_policy_version=max(versions),
    )
    fid = hdf5.create_file(path, SEAL_SIZE)
    try:
        for name, value in {"schema": SCHEMA_NAME, **dataclasses.asdict(header)}.items():
            hdf5.put_attribute(fid, name, value)
        datasets = _ChecksummedDatasets(fid)
        _write_samples(datasets, groups, samples)
        _write_group_media(datasets, groups)
        checksums = {**datasets.checksums, HEADER_CHECKSUM_KEY: _header_checksum(header)}
        hdf5.put_attribute(fid, CHECKSUMS_ATTR, json.dumps(checksums, sort_keys=True))
    finally:
        hdf5.close_file(fid)
    seal(path)
    return header


def seal(path: Path) -> None:
    """Write the seal of a shard file (the writer; a tool that rewrote a shard on purpose)."""
    with open(path, "r+b") as handle:
        handle.seek(SEAL_SIZE)
        length, crc = _crc_to_end(handle)
        handle.seek(0)
        handle.write(_SEAL.pack(SEAL_MAGIC, length, crc))


def _crc_to_end(handle) -> tuple[int, int]:
    length, crc = 0, 0
    while chunk := handle.read(_CRC_CHUNK):
        length, crc = length + len(chunk), zlib.crc32(chunk, crc)
    return length, crc


# --- decoding ------------------------------------------------------------------------------------
def _read_group_media(
    cols: Columns, h5: h5py.File, group_sizes: Sequence[int]
) -> dict[tuple[int, int], MediaPayload]:
    """(group, sample or -1 for the whole group) -> its ``MediaPayload`` (empty without
    ``media/`` datasets)."""
    if "media" not in h5:
        return {}
    indices = cols.array("media/groups", np.int64).tolist()
    owners = _media_owners(cols, h5, indices, group_sizes)
    metas = json_list(cols.array("media/meta", np.uint8), "media/meta", len(indices))
    image_values = cols.array("media/image/values", np.uint8)
    shapes = cols.array("media/image/shapes", np.int64)
    if len(shapes) % 3 or np.any(shapes[2::3] != 3) or np.any(shapes < 1):
        raise ShardCorruptError("media/image/shapes are not (H, W, 3) triples")
    shapes = shapes.reshape(-1, 3)
    image_offsets = cols.offsets("media/image/offsets", len(shapes), len(indices) + 1)
    pixel_offsets = _offsets(np.prod(shapes, axis=1).tolist())
    if pixel_offsets[-1] != len(image_values):
        raise ShardCorruptError("media/image/values do not match media/image/shapes")
    audio_values = cols.array("media/audio/values", np.float32)
    lengths = cols.array("media/audio/lengths", np.int64)
    clip_offsets = cols.offsets("media/audio/offsets", len(lengths), len(indices) + 1)
    sample_offsets = _offsets(lengths.tolist())
    if sample_offsets[-1] != len(audio_values) or np.any(lengths < 0):
        raise ShardCorruptError("media/audio/values do not match media/audio/lengths")
    payloads = {}
    for m in range(len(indices)):
        i0, i1 = int(image_offsets[m]), int(image_offsets[m + 1])
        c0, c1 = int(clip_offsets[m]), int(clip_offsets[m + 1])
        arrays = {
            "image/values": image_values[pixel_offsets[i0] : pixel_offsets[i1]],
            "image/shapes": shapes[i0:i1],
            "audio/values": audio_values[sample_offsets[c0] : sample_offsets[c1]],
            "audio/lengths": lengths[c0:c1],
        }
        payloads[owners[m]] = _payload(arrays, metas[m])
    return payloads


def _media_owners(
    cols: Columns, h5: h5py.File, indices: list[int], group_sizes: Sequence[int]
) -> list[tuple[int, int]]:
    """(group, sample) of each stored payload, checked: increasing, in range, and a whole
    group's payload alone in its group."""
    samples = [-1] * len(indices)
    if "media/samples" in h5:
        samples = cols.array("media/samples", np.int64, len(indices)).tolist()
    owners = list(zip(indices, samples, strict=True))
    whole = [g for g, j in owners if j == -1]
    in_range = all(0 <= g < len(group_sizes) and -1 <= j < group_sizes[g] for g, j in owners)
    if (
        owners != sorted(set(owners))
        or not in_range
        or len(whole) != len(set(whole))
        or any(indices.count(g) > 1 for g in whole)
    ):
        raise ShardCorruptError(f"media/groups and media/samples {owners} name no valid owners")
    return owners


def _payload(arrays: dict[str, np.ndarray], meta: Any) -> MediaPayload:
    if not isinstance(meta, dict) or not {"sampling_rate_hz", "fingerprint"} <= set(meta):
        raise ShardCorruptError(f"media/meta entry {meta!r} lacks sampling_rate_hz/fingerprint")
    payload = MediaPayload.from_arrays(arrays, meta)
    for array in (*payload.images, *payload.audio):
        array.flags.writeable = False  # shared by a group's samples: nobody writes into it
    return payload


def _header(h5: h5py.File, source: str) -> tuple[ShardHeader, dict[str, int]]:
    """The header, trusted only once its checksum holds (then a newer version is one), and
    the stored checksums (read once, like every attribute: each read costs libhdf5 ~20 us
    through the low-level API, ~60 through ``h5.attrs``)."""
    header = _header_fields(h5, source)
    try:
        checksums = _stored_checksums(h5)
    except ShardCorruptError as error:
        raise ShardCorruptError(f"{source}: {error}") from None
    if checksums.get(HEADER_CHECKSUM_KEY) != _header_checksum(header):
        raise ShardCorruptError(
            f"{source}: header checksum mismatch: the shard's attributes changed"
        )
    version = header.schema_version
    if version > SCHEMA_VERSION:
        raise ShardVersionError(
            f"{source}: shard schema_version {version} is newer than this code reads "
            f"(<= {SCHEMA_VERSION}); run the same relax_hpc version on trainer and rollout"
        )
    if version < MIN_SCHEMA_VERSION:
        raise ShardCorruptError(
            f"{source}: schema_version {version} carries no payload checksums (this code reads "
            f"{MIN_SCHEMA_VERSION}..{SCHEMA_VERSION}); an unverifiable shard is not trusted"
        )
    return header, checksums


def _header_fields(h5: h5py.File, source: str) -> ShardHeader:
    """The header attributes as stored; any that cannot be decoded is corruption."""

    def attr(name: str) -> Any:
        return hdf5.get_attribute(h5.id, name)

    try:
        if hdf5.get_attribute(h5.id, "schema", default=None) != SCHEMA_NAME:
            raise ShardCorruptError(f"{source}: not a relax_hpc spool shard (schema attribute)")
        return ShardHeader(
            schema_version=int(attr("schema_version")),
            writer_id=str(attr("writer_id")),
            created_unix_s=float(attr("created_unix_s")),
            num_groups=int(attr("num_groups")),
            num_samples=int(attr("num_samples")),
            min_policy_version=int(attr("min_policy_version")),
            max_policy_version=int(attr("max_policy_version")),
        )
    except ShardCorruptError:
        raise
    except KeyError as error:
        raise ShardCorruptError(f"{source}: missing attribute {error}") from None
    except Exception as error:  # a damaged attribute: h5py and numpy raise many kinds
        detail = f"{type(error).__name__}: {error}"
        raise ShardCorruptError(f"{source}: unreadable header attribute ({detail})") from None


def _stored_checksums(h5: h5py.File) -> dict[str, int]:
    try:
        checksums = json.loads(str(hdf5.get_attribute(h5.id, CHECKSUMS_ATTR)))
    except KeyError:
        raise ShardCorruptError(f"missing attribute {CHECKSUMS_ATTR!r}") from None
    except Exception as error:  # not JSON, or an attribute h5py cannot decode
        raise ShardCorruptError(f"attribute {CHECKSUMS_ATTR!r} is not JSON: {error}") from None
    if not isinstance(checksums, dict) or not all(isinstance(v, int) for v in checksums.values()):
        raise ShardCorruptError(f"attribute {CHECKSUMS_ATTR!r} is not a name -> crc32 map")
    return checksums


def _read_groups(h5: h5py.File, header: ShardHeader, checksums: dict[str, int]) -> list[Group]:
    n = header.num_samples
    checksums = dict(checksums)  # the header's: checked
    checksums.pop(HEADER_CHECKSUM_KEY)  # held: _header checked it
    cols = Columns(h5, n, checksums)
    text = TEXT_READERS[header.schema_version](cols, n, header.num_groups)
    images = cols.array_lists("images", np.uint8)
    waveforms = cols.array_lists("audio", np.float32)
    num_clips = sum(len(w) for w in waveforms)
    rates = cols.array("audio/sample_rate_hz", np.int64, num_clips).tolist() if num_clips else []
    group_sizes = np.diff(text.group_offsets).tolist()
    media = _read_group_media(cols, h5, group_sizes)
    cols.check_all_read()  # before any sample is built: a shard is never half-trusted
    rate_iter = iter(rates)
    columns = {
        **text.jsons,
        **text.scalars,
        "prompt_token_ids": text.prompts,
        "response_token_ids": text.responses,
        "loss_mask": text.masks,
        "rollout_logprobs": text.logprobs,
        "images": images,
        "audio": [[AudioClip(w, next(rate_iter)) for w in clips] for clips in waveforms],
        "media": [None] * n,  # set below, one object per group (or sample)
    }
    # One row of every column per sample, in the order of Sample's fields: zip, no
    # per-sample indexing of ~17 columns, and positional arguments (a keyword dict per
    # sample cost 5x as much: ~0.25 ms a 128-sample shard).
    rows = zip(*(columns[name] for name in _SAMPLE_FIELDS), strict=True)  # n values each
    samples = [Sample(*row) for row in rows]
    groups = [samples[a:b] for a, b in itertools.pairwise(text.group_offsets.tolist())]
    for (index, j), payload in media.items():
        for sample in groups[index] if j == -1 else [groups[index][j]]:
            sample.media = payload  # one object per group (or sample), as the writer had it
    return groups


def _check_decoded(groups: list[Group], header: ShardHeader) -> None:
    for index, group in enumerate(groups):
        if not group or len({s.group_id for s in group}) != 1:
            raise ShardCorruptError(f"group {index} is empty or mixes group ids")
    versions = [s.policy_version for group in groups for s in group]
    if (min(versions), max(versions)) != (header.min_policy_version, header.max_policy_version):
        raise ShardCorruptError("policy_version range disagrees with the header")


def _check_seal(path: Path) -> bool:
    """True when the seal holds; False for a file without one (written before the seal, or
    its magic damaged: ``_open`` tells them apart). A broken seal is corruption."""
    with open(path, "rb") as handle:
        magic, length, crc = _SEAL.unpack(handle.read(_SEAL.size).ljust(_SEAL.size, b"\0"))
        if magic != SEAL_MAGIC:
            return False
        handle.seek(SEAL_SIZE)
        found_length, found_crc = _crc_to_end(handle)
    if found_length != length:
        raise ShardCorruptError(f"{path.name}: truncated: {found_length} of {length} bytes")
    if found_crc != crc:
        raise ShardCorruptError(
            f"{path.name}: checksum mismatch in the file's seal: its bytes changed"
        )
    return True


def _open(path: Path) -> h5py.File:
    """The shard opened by libhdf5 only after its seal held: a damaged byte in HDF5's own
    metadata can crash the library (found: a segfault reading an attribute)."""
    try:
        sealed = _check_seal(path)
        h5 = h5py.File(path, "r")
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as error:
        if not path.exists():  # renamed (claimed, collected) after its seal was read
            raise FileNotFoundError(f"{path}: gone before HDF5 opened it") from None
        raise ShardCorruptError(f"{path.name}: unreadable HDF5 ({error})") from None
    if not sealed and h5.userblock_size:
        h5.close()  # it was sealed: the magic itself is damaged
        raise ShardCorruptError(f"{path.name}: the file's seal is damaged")
    return h5


def read_shard(path: Path | str) -> tuple[ShardHeader, list[Group]]:
    """Header and groups of a shard file, validated; raises ShardCorruptError/ShardVersionError."""
    path = Path(path)
    h5 = _open(path)
    try:
        header, checksums = _header(h5, path.name)
        if header.num_groups < 1:
            raise ShardCorruptError("a shard must hold at least one group")
        groups = _read_groups(h5, header, checksums)
        _check_decoded(groups, header)
        return header, groups
    except ShardCorruptError as error:
        if str(error).startswith(path.name):
            raise
        raise ShardCorruptError(f"{path.name}: {error}") from None
    except (OSError, ValueError, TypeError, KeyError) as error:
        detail = f"{type(error).__name__}: {error}"
        raise ShardCorruptError(f"{path.name}: invalid shard ({detail})") from None
    finally:
        h5.close()


def read_header(path: Path | str) -> ShardHeader:
    """Only the attributes of a shard (after its seal; does not decode the datasets)."""
    path = Path(path)
    with _open(path) as h5:
        return _header(h5, path.name)[0]
