"""Lifecycle events of weight sync, one JSON file each in ``RunPaths.events_dir``.

Alerts and status tools read these files; this module only writes them. Event names:
``weightsync_peer_dropped``, ``weightsync_peer_refused``, ``weightsync_verification_failed``,
``weightsync_fs_fallback``.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from relax_hpc.paths import RunPaths, atomic_write_json


def emit_event(paths: RunPaths, event: str, **fields: Any) -> Path:
    """Write ``{"event": event, "time_unix": ..., **fields}``; the name sorts by time."""
    now = time.time()
    name = f"{time.time_ns()}-{event}-{os.getpid()}-{secrets.token_hex(2)}.json"
    record = {"event": event, "time_unix": now, "pid": os.getpid(), **fields}
    return atomic_write_json(paths.events_dir / name, record)
