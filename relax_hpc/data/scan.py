"""A prompt file read through once at submit: every row must load where the rollout reads it.

A JSONL file is decoded line by line (UTF-8, one JSON object per non-empty line); a Parquet
file must open and have a schema. What is wrong raises ``DataFileError`` with the file and
the line, so that ``submit`` exits with 2 naming it instead of a rollout that fails at every
start. Returns the columns (dotted keys of nested objects) the first row has.

Must not: import torch or transformers (it runs in ``submit``).
"""

from __future__ import annotations

import json
from pathlib import Path


class DataFileError(ValueError):
    """A data file that cannot be read as prompts: ``where`` is ``path`` or ``path:line``."""

    def __init__(self, where: str, why: str) -> None:
        super().__init__(f"{where}: {why}")
        self.where = where


def scan_columns(path: Path, kind: str) -> set[str]:
    """The first row's dotted columns, after checking that every row of ``path`` reads."""
    if kind == "parquet":
        return _parquet_columns(path)
    return _scan_jsonl(path)


def _scan_jsonl(path: Path) -> set[str]:
    first: set[str] | None = None
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            row = _jsonl_row(raw, f"{path}:{number}")
            if row is not None and first is None:
                first = dotted_keys(row)
    return first or set()


def _jsonl_row(raw: bytes, where: str) -> dict | None:
    """One line as a JSON object; None for a blank line (skipped, as the reader does)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataFileError(
            where,
            f"not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
            "re-encode the file as UTF-8",
        ) from None
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataFileError(
            where, f"not JSON ({err.msg} at column {err.colno}); one JSON object per line"
        ) from None
    if not isinstance(row, dict):
        raise DataFileError(where, f"a JSON {type(row).__name__}, not an object with columns")
    return row


def dotted_keys(row: dict, prefix: str = "") -> set[str]:
    found = set()
    for key, value in row.items():
        found.add(prefix + key)
        if isinstance(value, dict):
            found |= dotted_keys(value, f"{prefix}{key}.")
    return found


def _parquet_columns(path: Path) -> set[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def names(fields, prefix: str = "") -> set[str]:
        found = set()
        for item in fields:
            found.add(prefix + item.name)
            if pa.types.is_struct(item.type):
                found |= names(list(item.type), f"{prefix}{item.name}.")
        return found

    try:
        return names(list(pq.read_schema(path)))
    except (pa.ArrowException, OSError) as err:
        raise DataFileError(str(path), f"not a readable Parquet file ({err})") from None
