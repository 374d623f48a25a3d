"""Reading an open shard's datasets, checked, and the per-sample columns of each version.

``Columns`` reads a dataset only through its CRC-32 in the shard's ``checksums`` and turns
any h5py, shape, dtype, offsets or JSON problem into ``ShardCorruptError`` naming the
dataset; ``check_all_read`` then makes sure no listed dataset was skipped. ``TEXT_READERS``
maps each schema version the reader accepts to the function that decodes its per-sample
columns (the layouts are in ``format``'s docstring): version 2 keeps one dataset per column
and per offsets array, version 3 packs them into seven and version 4 into one, because
h5py costs ~0.1 ms per dataset on each side (~0.3 ms in a running trainer), more than the
bytes of a small shard. Must not: open files or judge headers
(``format`` does, before any dataset is read).
"""

from __future__ import annotations

import itertools
import json
import zlib
from typing import Any, NamedTuple

import h5py
import numpy as np

from relax_hpc.spool.errors import ShardCorruptError

JSON_COLUMNS = {
    "sample_id": str,
    "group_id": str,
    "finish_reason": str,
    "reward_details": dict,
    "timings_s": dict,
    "metadata": dict,
}
SCALAR_COLUMNS = {
    "data_index": np.int64,
    "policy_version": np.int64,
    "num_turns": np.int64,
    "reward": np.float64,
}
# Version 3's ``sample/scalars``: the scalar columns as one little-endian compound (N,).
SCALARS_DTYPE = np.dtype([(c, np.dtype(t).newbyteorder("<")) for c, t in SCALAR_COLUMNS.items()])


class Columns:
    """Reads datasets of an open shard, turning any h5py/shape problem into ShardCorruptError.

    Every dataset read is checked against its CRC-32 in ``checksums``; ``check_all_read``
    then makes sure no listed dataset was skipped (e.g. a damaged group name).
    """

    def __init__(self, h5: h5py.File, num_samples: int, checksums: dict[str, int]) -> None:
        self._h5 = h5
        self._num_samples = num_samples
        self._checksums = checksums
        self._verified: set[str] = set()

    def array(self, name: str, dtype: type, length: int | None = None) -> np.ndarray:
        values = self._read(name)
        self._verify(name, values)
        if values.ndim != 1 or (length is not None and len(values) != length):
            raise ShardCorruptError(f"dataset {name!r} has shape {values.shape}, want ({length},)")
        if values.dtype != dtype:
            raise ShardCorruptError(f"dataset {name!r} has dtype {values.dtype}, want {dtype}")
        values.flags.writeable = False
        return values

    def _read(self, name: str) -> np.ndarray:
        """The whole dataset ``name`` in its stored dtype. Through h5py's low-level API: the
        high-level ``Dataset[()]`` costs twice as much per dataset (selections, a Dataset
        object), and a shard is read on the trainer's critical path every step."""
        try:
            dataset = h5py.h5d.open(self._h5.id, name.encode("utf-8"))
        except KeyError:
            raise ShardCorruptError(f"missing dataset {name!r}") from None
        if dataset.shape is None:  # a null dataspace
            raise ShardCorruptError(f"dataset {name!r} holds no dataspace")
        values = np.empty(dataset.shape, dataset.dtype)
        if values.size:
            dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, values)
        return values

    def _verify(self, name: str, values: np.ndarray) -> None:
        if name not in self._checksums:
            raise ShardCorruptError(f"dataset {name!r} has no checksum")
        computed = zlib.crc32(values)
        if computed != self._checksums[name]:
            raise ShardCorruptError(
                f"payload checksum mismatch in dataset {name!r} (stored crc32 "
                f"{self._checksums[name]:08x}, computed {computed:08x}): the shard's bytes "
                "changed after it was written (storage or transfer fault)"
            )
        self._verified.add(name)

    def check_all_read(self) -> None:
        unread = sorted(set(self._checksums) - self._verified)
        if unread:
            raise ShardCorruptError(f"datasets {unread} have checksums but were not decoded")

    def offsets(self, name: str, num_values: int | None, length: int | None = None) -> np.ndarray:
        """Offsets ``(length,)`` (default N+1) partitioning ``num_values`` (None: any count)."""
        length = self._num_samples + 1 if length is None else length
        return checked_offsets(repr(name), self.array(name, np.int64, length), num_values)

    def ragged(self, values_name: str, offsets_name: str, dtype: type) -> list[np.ndarray]:
        values = self.array(values_name, dtype)
        offsets = self.offsets(offsets_name, len(values))
        return [values[a:b] for a, b in itertools.pairwise(offsets.tolist())]

    def split(
        self, values_name: str, offsets: np.ndarray, offsets_name: str, dtype: type
    ) -> list[np.ndarray]:
        """``values_name`` cut at ``offsets`` (part of a dataset already read and verified)."""
        values = self.array(values_name, dtype)
        checked_offsets(offsets_name, offsets, len(values))
        return [values[a:b] for a, b in itertools.pairwise(offsets.tolist())]

    def json_column(self, name: str, kind: type) -> list[Any]:
        """A JSON array of N values of type ``kind``."""
        values = decode_json(self.array(name, np.uint8), f"column {name!r}")
        return self._checked_column(repr(name), values, kind)

    def json_columns(self, name: str, kinds: dict[str, type]) -> dict[str, list[Any]]:
        """A JSON object mapping each column of ``kinds`` to its N values."""
        return self.json_section(name, self.array(name, np.uint8), kinds)

    def json_section(
        self, name: str, blob: np.ndarray, kinds: dict[str, type]
    ) -> dict[str, list[Any]]:
        """``json_columns`` of ``blob``, bytes of the (verified) dataset ``name``."""
        columns = decode_json(blob, repr(name))
        if not isinstance(columns, dict) or set(columns) != set(kinds):
            raise ShardCorruptError(f"{name!r} is not an object of the columns {sorted(kinds)}")
        return {c: self._checked_column(f"{c!r} of {name!r}", columns[c], kinds[c]) for c in kinds}

    def _checked_column(self, label: str, values: Any, kind: type) -> list[Any]:
        if not isinstance(values, list) or len(values) != self._num_samples:
            raise ShardCorruptError(f"column {label} is not a list of {self._num_samples} values")
        if not set(map(type, values)) <= {kind}:  # JSON decodes to exact types
            raise ShardCorruptError(f"column {label} holds values that are not {kind.__name__}")
        return values

    def array_lists(self, name: str, dtype: type) -> list[list[np.ndarray]]:
        if name not in self._h5:
            return [[] for _ in range(self._num_samples)]
        values = self.array(f"{name}/values", dtype)
        sample_offsets = self.offsets(f"{name}/sample_offsets", None)
        num_arrays = int(sample_offsets[-1])
        value_offsets = self.offsets(f"{name}/value_offsets", len(values), num_arrays + 1)
        shapes = self.array(f"{name}/shapes", np.int64)
        shape_offsets = self.offsets(f"{name}/shape_offsets", len(shapes), num_arrays + 1)
        arrays = []
        for i in range(num_arrays):
            shape = tuple(shapes[shape_offsets[i] : shape_offsets[i + 1]].tolist())
            flat = values[value_offsets[i] : value_offsets[i + 1]]
            if int(np.prod(shape)) != flat.size:
                raise ShardCorruptError(f"{name} array {i}: shape {shape} != {flat.size} values")
            arrays.append(flat.reshape(shape))
        bounds = itertools.pairwise(sample_offsets.tolist())
        return [arrays[a:b] for a, b in bounds]


def json_list(blob: np.ndarray, name: str, length: int) -> list[Any]:
    values = decode_json(blob, repr(name))
    if not isinstance(values, list) or len(values) != length:
        raise ShardCorruptError(f"{name!r} is not a list of {length} values")
    return values


def decode_json(blob: np.ndarray, label: str) -> Any:
    try:
        return json.loads(blob.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ShardCorruptError(f"{label} is not utf-8 JSON: {error}") from None


def checked_offsets(label: str, offsets: np.ndarray, num_values: int | None) -> np.ndarray:
    """``offsets`` if they start at 0, never decrease and end at ``num_values`` (None: any)."""
    end_ok = num_values is None or offsets[-1] == num_values
    if offsets[0] != 0 or not end_ok or np.any(np.diff(offsets) < 0):
        raise ShardCorruptError(f"offsets {label} do not partition {num_values} values")
    return offsets


class TextColumns(NamedTuple):
    """What every schema version stores per sample, decoded and checked: the group
    partition, the JSON and scalar columns (name -> N values) and the token arrays."""

    group_offsets: np.ndarray
    jsons: dict[str, list[Any]]
    scalars: dict[str, list[Any]]
    prompts: list[np.ndarray]
    responses: list[np.ndarray]
    masks: list[np.ndarray]
    logprobs: list[np.ndarray]


def read_text_v2(cols: Columns, num_samples: int, num_groups: int) -> TextColumns:
    """Version 2: one dataset per column, an offsets dataset per ragged array."""
    n = num_samples
    return TextColumns(
        group_offsets=cols.offsets("groups/offsets", n, num_groups + 1),
        jsons={c: cols.json_column(f"sample/{c}", kind) for c, kind in JSON_COLUMNS.items()},
        scalars={c: cols.array(f"sample/{c}", t, n).tolist() for c, t in SCALAR_COLUMNS.items()},
        prompts=cols.ragged("prompt/token_ids", "prompt/offsets", np.int32),
        responses=cols.ragged("response/token_ids", "response/offsets", np.int32),
        masks=cols.ragged("response/loss_mask", "response/offsets", np.uint8),
        logprobs=cols.ragged("response/rollout_logprobs", "response/offsets", np.float32),
    )


def read_text_v3(cols: Columns, num_samples: int, num_groups: int) -> TextColumns:
    """Version 3: the packed ``offsets``, ``sample/scalars`` and ``sample/json``."""
    n, g = num_samples, num_groups
    packed = cols.array("offsets", np.int64, packed_offsets_count(g, n))
    groups, prompt, response = np.split(packed, [g + 1, g + 1 + n + 1])
    scalars = cols.array("sample/scalars", SCALARS_DTYPE, n)

    def responses(name: str, dtype: type) -> list[np.ndarray]:
        return cols.split(f"response/{name}", response, "'offsets' (response)", dtype)

    return TextColumns(
        group_offsets=checked_offsets("'offsets' (groups)", groups, n),
        jsons=cols.json_columns("sample/json", JSON_COLUMNS),
        scalars={c: scalars[c].tolist() for c in SCALAR_COLUMNS},
        prompts=cols.split("prompt/token_ids", prompt, "'offsets' (prompt)", np.int32),
        responses=responses("token_ids", np.int32),
        masks=responses("loss_mask", np.uint8),
        logprobs=responses("rollout_logprobs", np.float32),
    )


def packed_offsets_count(num_groups: int, num_samples: int) -> int:
    """Values in the three offsets arrays end to end (groups, prompts, responses)."""
    return (num_groups + 1) + 2 * (num_samples + 1)


def text_sections(
    num_groups: int, num_samples: int, num_prompt_tokens: int, num_response_tokens: int
) -> tuple[list[tuple[str, np.dtype, int, int]], int]:
    """Version 4's ``text`` blob: (name, dtype, start, end byte) of each section before the
    JSON, each starting at a multiple of 8 bytes, and where the JSON starts (it fills the
    rest)."""
    n, r = num_samples, num_response_tokens
    counts = [
        ("offsets", np.dtype("<i8"), packed_offsets_count(num_groups, n)),
        ("scalars", SCALARS_DTYPE, n),
        ("prompt/token_ids", np.dtype("<i4"), num_prompt_tokens),
        ("response/token_ids", np.dtype("<i4"), r),
        ("response/loss_mask", np.dtype("u1"), r),
        ("response/rollout_logprobs", np.dtype("<f4"), r),
    ]
    sections, start = [], 0
    for name, dtype, count in counts:
        end = start + count * dtype.itemsize
        sections.append((name, dtype, start, end))
        start = -(-end // 8) * 8
    return sections, start


def read_text_v4(cols: Columns, num_samples: int, num_groups: int) -> TextColumns:
    """Version 4: every text column in the one ``text`` blob (``text_sections``), cut into
    zero-copy views: one dataset to read where version 3 had seven."""
    n, g = num_samples, num_groups
    blob = cols.array("text", np.uint8)
    offsets_bytes = packed_offsets_count(g, n) * 8
    if len(blob) < offsets_bytes:
        raise ShardCorruptError(f"'text' holds {len(blob)} bytes, fewer than its offsets")
    packed = blob[:offsets_bytes].view("<i8")
    groups, prompt, response = np.split(packed, [g + 1, g + 1 + n + 1])
    for label, part in (("groups", groups), ("prompt", prompt), ("response", response)):
        checked_offsets(f"'text' ({label})", part, None)
    layout, json_start = text_sections(g, n, int(prompt[-1]), int(response[-1]))
    sections = {}
    for name, dtype, start, end in layout:
        if end > len(blob):
            raise ShardCorruptError(f"'text' ends inside its {name!r} section")
        sections[name] = blob[start:end].view(dtype)
    if json_start > len(blob):
        raise ShardCorruptError("'text' holds no JSON section")
    scalars = sections["scalars"]

    def cut(name: str, bounds: np.ndarray) -> list[np.ndarray]:
        values = sections[name]
        return [values[a:b] for a, b in itertools.pairwise(bounds.tolist())]

    return TextColumns(
        group_offsets=checked_offsets("'text' (groups)", groups, n),
        jsons=cols.json_section("text", blob[json_start:], JSON_COLUMNS),
        scalars={c: scalars[c].tolist() for c in SCALAR_COLUMNS},
        prompts=cut("prompt/token_ids", prompt),
        responses=cut("response/token_ids", response),
        masks=cut("response/loss_mask", response),
        logprobs=cut("response/rollout_logprobs", response),
    )


TEXT_READERS = {2: read_text_v2, 3: read_text_v3, 4: read_text_v4}
