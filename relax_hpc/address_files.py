"""Published-address files: how a server started by one job step tells the others where it is.

The weight-sync trainer (``weightsync.rendezvous``) and the judge's servers
(``rollout.rewards.judge_address``) each publish a small JSON record (host, port, token,
instance, pid, ...) in the run's rendezvous folder. The folder is 0700 and each file 0600,
because the records hold the run's tokens; files are written to a temp name then renamed,
so a reader never sees half a record; and a reader skips a file it cannot parse (being
replaced right now, or not a record of that kind) instead of failing.

Must not: do network I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

from relax_hpc.paths import atomic_write_json, read_json

PRIVATE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700

Record = TypeVar("Record")


def publish_record(path: Path, record: Any) -> Path:
    """Write the dataclass ``record`` to ``path`` (0600, atomically; folders made 0700)."""
    path.parent.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    return atomic_write_json(path, asdict(record), mode=PRIVATE_MODE)


def read_record(path: Path, make: Callable[..., Record]) -> Record | None:
    """The record in ``path`` built by ``make(**fields)``; None when missing or unreadable."""
    try:
        return make(**read_json(path))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def read_records(folder: Path, make: Callable[..., Record]) -> list[tuple[Path, Record]]:
    """Every readable record in ``folder``'s ``*.json`` files, by file name."""
    if not folder.is_dir():
        return []
    found = ((path, read_record(path, make)) for path in sorted(folder.glob("*.json")))
    return [(path, record) for path, record in found if record is not None]
