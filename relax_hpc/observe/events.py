"""Lifecycle events, one JSON file each in ``RunPaths.events_dir``, named so they sort by time.

Written by the process the event happened to (weight sync: ``weightsync_peer_dropped``,
``weightsync_peer_refused``, ``weightsync_verification_failed``, ``weightsync_fs_fallback``;
a rollout task's keeper: ``component_restarted``, ``component_gave_up``; a launcher that
restarts a crashed trainer alone, through ``observe.watch``: ``trainer_restarted``); read by
the run watcher (alerts, TensorBoard) and the status tools. Must not: import torch.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from relax_hpc.paths import RunPaths, atomic_write_json, read_json


def emit_event(paths: RunPaths, event: str, **fields: Any) -> Path:
    """Write ``{"event": event, "time_unix": ..., **fields}``; the name sorts by time."""
    now = time.time()
    name = f"{time.time_ns()}-{event}-{os.getpid()}-{secrets.token_hex(2)}.json"
    record = {"event": event, "time_unix": now, "pid": os.getpid(), **fields}
    return atomic_write_json(paths.events_dir / name, record)


def read_events(paths: RunPaths, prefix: str = "") -> list[tuple[str, dict]]:
    """Every event whose kind starts with ``prefix``, oldest first, as (file name, record)."""
    if not paths.events_dir.is_dir():
        return []
    found = []
    for path in sorted(paths.events_dir.glob("*.json")):
        kind = path.name.split("-", 2)[1] if path.name.count("-") >= 2 else ""
        if not kind.startswith(prefix):
            continue
        try:
            record = read_json(path, default=None)
        except OSError:  # a folder or an unreadable file among the events: not an event
            continue
        if isinstance(record, dict):
            found.append((path.name, record))
    return found
