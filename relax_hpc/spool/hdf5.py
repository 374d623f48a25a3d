"""The few HDF5 calls a shard makes, through h5py's low-level API.

A shard is written on the rollout's path from new weights to the trainer's next batch and
read on the trainer's path every step, and at a grpo_tiny shard's size (~40 KB, 9 attributes,
one dataset) h5py's high-level objects cost more than the bytes: ``File``, ``Dataset`` and
``AttributeManager`` build selections, property lists and registry entries per call. The
low-level calls below write the same shard (the same datasets, dtypes and attribute types:
a variable-length UTF-8 string per ``str``, a scalar per number) at ~2/3 of the CPU
(``benchmarks/shard_io.py``, version-3 shards: ~3.1 -> ~2.4 ms a write), and read an
attribute at ~1/3.

Every identifier opened here is closed here: a file created with ``create_file`` is closed
by ``close_file`` only after its datasets and attributes are, so that its bytes are on the
file (not in HDF5's cache) before the caller seals it. Must not: know the shard layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

_SCALAR_SPACE = h5py.h5s.create(h5py.h5s.SCALAR)
_STRING_FILE_TYPE = h5py.h5t.py_create(h5py.string_dtype(), logical=True)  # UTF-8, vlen
_STRING_MEMORY_TYPE = h5py.h5t.py_create(h5py.string_dtype())  # Python str objects


def _intermediate_groups() -> h5py.h5p.PropLCID:
    plist = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    plist.set_create_intermediate_group(True)  # "images/values" creates "images"
    return plist


def _untimed_datasets() -> h5py.h5p.PropDCID:
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    plist.set_obj_track_times(False)  # as h5py: no timestamps, so equal shards are equal bytes
    return plist


_LINK_CREATE = _intermediate_groups()
_DATASET_CREATE = _untimed_datasets()


def create_file(path: Path, userblock_size: int) -> h5py.h5f.FileID:
    """A new HDF5 file at ``path`` (an OSError if it exists), in the format versions that
    ``h5py.File`` writes: the earliest that can hold each object, so that readers with an
    older libhdf5 read it (libhdf5's own default floor is newer)."""
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_userblock(userblock_size)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_LATEST)
    return h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_EXCL, fcpl=fcpl, fapl=fapl)


def close_file(fid: h5py.h5f.FileID) -> None:
    fid.close()


def put_dataset(fid: h5py.h5f.FileID, name: str, array: np.ndarray) -> None:
    """A new contiguous dataset ``name`` holding ``array`` (C-contiguous)."""
    dataset = h5py.h5d.create(
        fid,
        name.encode("utf-8"),
        h5py.h5t.py_create(array.dtype),
        h5py.h5s.create_simple(array.shape),
        lcpl=_LINK_CREATE,
        dcpl=_DATASET_CREATE,
    )
    try:
        if array.size:
            dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, array)
    finally:
        dataset.close()


def put_attribute(fid: h5py.h5f.FileID, name: str, value: str | int | float) -> None:
    """A scalar attribute: a ``str`` as a variable-length UTF-8 string, as h5py stores it."""
    if isinstance(value, str):
        data = np.array(value, dtype=h5py.string_dtype())
        file_type, memory_type = _STRING_FILE_TYPE, _STRING_MEMORY_TYPE
    else:
        data = np.asarray(value)
        file_type = memory_type = h5py.h5t.py_create(data.dtype)
    attribute = h5py.h5a.create(fid, name.encode("utf-8"), file_type, _SCALAR_SPACE)
    try:
        attribute.write(data, mtype=memory_type)
    finally:
        attribute.close()


_MISSING = object()


def get_attribute(object_id: h5py.h5o.ObjectID, name: str, default: Any = _MISSING) -> Any:
    """The value of attribute ``name`` of an open file or object; strings decoded from
    UTF-8. When it is missing: ``default``, or KeyError without one; anything else (h5py,
    numpy, UnicodeDecodeError) when it cannot be decoded."""
    try:  # no exists() first: one call fewer per attribute on the trainer's step
        attribute = h5py.h5a.open(object_id, name.encode("utf-8"))
    except KeyError:  # h5py's error for a missing attribute
        if default is _MISSING:
            raise KeyError(name) from None
        return default
    try:
        dtype = attribute.dtype
        value = np.empty(attribute.shape, dtype)
        attribute.read(value, mtype=_STRING_MEMORY_TYPE if dtype.kind == "O" else None)
    finally:
        attribute.close()
    value = value[()]
    return value.decode("utf-8") if isinstance(value, bytes) else value
