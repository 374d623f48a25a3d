"""Bad input: moving unreadable shards aside, returning them, and cleaning writers' debris.

A quarantined shard keeps its file name in ``quarantine/`` next to ``<name>.reason.json``.
The reason is written first and the shard renamed second, so a crash in between leaves an
orphan reason file (ignored by listings, removed by ``requeue``), never an unexplained
shard. Only the spool's consumer quarantines; only the operator requeues.

Temp files: a writer killed mid-publish leaves ``tmp/<shard>.<host>.<pid>.<token>.tmp``,
and a process killed inside ``atomic_write_json`` leaves ``<file>.<host>.<pid>.<token>.tmp``
beside a status file or a quarantine reason. One rule cleans every kind, in every folder
of the spool: a temp file is deleted when its writer is provably dead (this host, pid
gone) or when it is older than ``tmp_max_age_s`` (a live writer finishes one in seconds). Must not: touch
``ready/`` or ``claimed/`` shards other than the one being quarantined.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.paths import atomic_write_json, fsync_dir, read_json
from relax_hpc.spool.layout import (
    REASON_SUFFIX,
    TMP_SUFFIX,
    SpoolLayout,
    list_names,
    original_name,
    rename_once,
    tmp_writer_pid,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuarantinedShard:
    name: str
    reason: str
    quarantined_unix_s: float | None  # None: the reason file is missing


def quarantine_shard(layout: SpoolLayout, path: Path, reason: str) -> Path | None:
    """Move ``path`` into ``quarantine/`` with a reason file; None if it vanished meanwhile."""
    layout.quarantine_dir.mkdir(parents=True, exist_ok=True)
    target = layout.quarantine_dir / path.name
    reason_path = target.with_name(target.name + REASON_SUFFIX)
    record = {"reason": reason, "from": path.parent.name, "quarantined_unix_s": time.time()}
    atomic_write_json(reason_path, record)
    if not rename_once(path, target):
        reason_path.unlink(missing_ok=True)
        return None
    fsync_dir(path.parent)
    fsync_dir(layout.quarantine_dir)
    log.warning("spool: quarantined %s: %s", path.name, reason)
    return target


def list_quarantined(layout: SpoolLayout) -> list[QuarantinedShard]:
    shards = []
    for name in list_names(layout.quarantine_dir, suffix=""):
        if name.endswith(REASON_SUFFIX) or name.endswith(TMP_SUFFIX):
            continue
        reason_path = layout.quarantine_dir / (name + REASON_SUFFIX)
        try:
            record = read_json(reason_path)
            shards.append(QuarantinedShard(name, record["reason"], record["quarantined_unix_s"]))
        except (FileNotFoundError, ValueError, KeyError):
            shards.append(QuarantinedShard(name, "(no reason file)", None))
    return shards


def requeue(layout: SpoolLayout, names: list[str] | None = None) -> list[str]:
    """Return quarantined shards (all when ``names`` is None) to ``ready/``; their new names.

    A claim prefix is stripped so the shard is claimed afresh. Groups the trainer already
    consumed from it are not trained twice: the reader drops already-seen sample ids.
    """
    known = {q.name for q in list_quarantined(layout)}
    wanted = sorted(known) if names is None else names
    missing = [n for n in wanted if n not in known]
    if missing:
        raise ValueError(f"not in quarantine: {', '.join(missing)}")
    requeued = []
    for name in wanted:
        target = layout.ready_dir / original_name(name)
        if rename_once(layout.quarantine_dir / name, target):
            (layout.quarantine_dir / (name + REASON_SUFFIX)).unlink(missing_ok=True)
            requeued.append(target.name)
    fsync_dir(layout.ready_dir)
    _remove_orphan_reasons(layout)
    return requeued


def _remove_orphan_reasons(layout: SpoolLayout) -> None:
    names = set(list_names(layout.quarantine_dir, suffix=""))
    for name in names:
        if name.endswith(REASON_SUFFIX) and name.removesuffix(REASON_SUFFIX) not in names:
            (layout.quarantine_dir / name).unlink(missing_ok=True)


def _writer_is_dead(name: str, host: str) -> bool:
    pid = tmp_writer_pid(name, host)
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's process
        return False
    return False


def clean_abandoned_tmp(
    layout: SpoolLayout, max_age_s: float, now_s: float | None = None
) -> list[str]:
    """Delete temp files of dead or long-gone writers; the names deleted."""
    now_s = time.time() if now_s is None else now_s
    host = socket.gethostname()
    deleted = []
    for folder in (layout.spool_dir, *layout.folders):
        for name in list_names(folder, suffix=TMP_SUFFIX):
            path = folder / name
            try:
                too_old = now_s - path.stat().st_mtime > max_age_s
            except FileNotFoundError:
                continue  # its writer finished (renamed it) meanwhile
            if too_old or _writer_is_dead(name, host):
                path.unlink(missing_ok=True)
                deleted.append(name)
    if deleted:
        log.info("spool: deleted %d abandoned temp files", len(deleted))
    return deleted
