"""The rollout side: publish groups as shards, and ask how far ahead of the trainer we are.

Publishing one shard: write the HDF5 file under ``tmp/``, fsync it, rename it into
``ready/`` under its final name, fsync ``ready/``. A reader lists only ``ready/*.h5``, so
it never sees a partial shard; a writer killed at any instruction leaves at most a temp
file (cleaned later, see ``quarantine``) and never a visible partial shard. Nothing is
buffered across calls: when ``publish`` returns, the groups are durable.

Duplicates: a restarted rollout worker may publish groups it had already published (it
crashed after the rename but before recording its progress). Sample ids are
deterministic upstream, and the reader drops and counts any sample id it already
delivered, so a duplicate costs bandwidth but is never trained twice.

Must not: move or delete anything outside ``tmp/`` and its own status file.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.paths import atomic_write_json, fsync_dir, fsync_file, read_json
from relax_hpc.spool.errors import SpoolTimeout
from relax_hpc.spool.format import write_shard_file
from relax_hpc.spool.layout import (
    ShardName,
    SpoolLayout,
    check_writer_id,
    default_writer_id,
    list_names,
)
from relax_hpc.spool.quarantine import clean_abandoned_tmp
from relax_hpc.spool.sample import Sample

_RECENT_PUBLISHES = 20  # [unix_s, cumulative samples] pairs kept for the status CLI
_STATUS_INTERVAL_S = 5.0  # refresh the operator's status file at most this often
_PUBLISH_ATTEMPTS = 2  # a temp deleted under us (misjudged as abandoned) is rewritten once


def split_into_shards(groups: Sequence[Sequence[Sample]], max_samples: int) -> list[list]:
    """Consecutive runs of whole groups with at most ``max_samples`` samples each.

    A single group larger than ``max_samples`` gets a shard of its own: groups are never split.
    """
    shards: list[list] = []
    current: list = []
    num_samples = 0
    for group in groups:
        if current and num_samples + len(group) > max_samples:
            shards.append(current)
            current, num_samples = [], 0
        current.append(group)
        num_samples += len(group)
    if current:
        shards.append(current)
    return shards


class ShardWriter:
    """Publishes groups into one spool; one instance per rollout process.

    ``writer_id`` names the writer in shard names and status (e.g. ``rollout.r3``); it
    must match ``[A-Za-z0-9_.]{1,64}``. Defaults to ``<host>.<pid>``.
    """

    def __init__(
        self,
        spool_dir: Path | str,
        writer_id: str | None = None,
        shard_max_samples: int = 256,
        tmp_max_age_s: float = 3600.0,
        clock: Callable[[], float] = time.time,
        on_published: Callable[[], None] = lambda: None,
    ) -> None:
        """``on_published`` runs after shards are published (the rollout nudges the
        trainer: it learns of them at once instead of at its next poll of ``ready/``)."""
        if shard_max_samples < 1:
            raise ValueError(f"spool.shard_max_samples must be >= 1, got {shard_max_samples}")
        self._layout = SpoolLayout(Path(spool_dir)).create()
        self.writer_id = check_writer_id(writer_id or default_writer_id())
        self._shard_max_samples = shard_max_samples
        self._clock = clock
        self._on_published = on_published
        self._seq = 0
        self._host = socket.gethostname()
        self._stats = self._load_stats()
        self._status_written_s = -_STATUS_INTERVAL_S
        self.last_num_bytes = 0  # file bytes of the shards of the last ``publish`` call
        clean_abandoned_tmp(self._layout, tmp_max_age_s)

    def publish(self, groups: Sequence[Sequence[Sample]]) -> list[Path]:
        """Publish whole groups as one or more shards, in order; the paths in ``ready/``."""
        shards = split_into_shards(groups, self._shard_max_samples)
        published = [self._publish_shard(shard) for shard in shards]
        self.last_num_bytes = sum(num_bytes for _, num_bytes in published)
        if published:
            self._on_published()
            self._save_stats(shards, self.last_num_bytes)
        return [path for path, _ in published]

    def _publish_shard(self, groups: list) -> tuple[Path, int]:
        for attempt in range(_PUBLISH_ATTEMPTS):
            created_s = self._clock()
            name = ShardName(
                created_ms=int(created_s * 1000),
                writer_id=self.writer_id,
                seq=self._seq,
                token=secrets.token_hex(4),
                min_policy_version=min(s.policy_version for g in groups for s in g),
                num_groups=len(groups),
                num_samples=sum(len(g) for g in groups),
            ).name
            self._seq += 1
            tmp = (
                self._layout.tmp_dir
                / f"{name}.{self._host}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            )
            final = self._layout.ready_dir / name
            try:
                write_shard_file(tmp, groups, self.writer_id, created_s)
                fsync_file(tmp)
                num_bytes = tmp.stat().st_size
                os.rename(tmp, final)  # final is unique: nobody else can create it
            except FileNotFoundError:
                tmp.unlink(missing_ok=True)
                if attempt + 1 == _PUBLISH_ATTEMPTS:
                    raise
                continue
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            fsync_dir(self._layout.ready_dir)
            return final, num_bytes
        raise AssertionError("unreachable")

    # --- per-writer status for the operator CLI -------------------------------------------------
    def _load_stats(self) -> dict:
        """Counters continue across restarts of the same ``writer_id`` (as of the last refresh)."""
        stats = {"num_shards": 0, "num_groups": 0, "num_samples": 0, "num_bytes": 0, "recent": []}
        try:
            previous = read_json(self._layout.writer_status_path(self.writer_id))
        except (FileNotFoundError, ValueError):
            return stats
        stats.update({k: previous[k] for k in stats if k in previous})
        return stats

    def _save_stats(self, shards: list[list], num_bytes: int) -> None:
        stats = self._stats
        stats["num_shards"] += len(shards)
        stats["num_groups"] += sum(len(s) for s in shards)
        stats["num_samples"] += sum(len(g) for s in shards for g in s)
        stats["num_bytes"] += num_bytes
        now_s = self._clock()
        stats["recent"] = [*stats["recent"], [now_s, stats["num_samples"]]][-_RECENT_PUBLISHES:]
        if now_s - self._status_written_s < _STATUS_INTERVAL_S:
            return
        self._status_written_s = now_s
        record = dict(stats, writer_id=self.writer_id, host=self._host, pid=os.getpid())
        record["last_publish_unix_s"] = now_s
        # Counters for the operator CLI, not accounting (the shards in ready/ are): no
        # fsync; a crash may lose the counts since the last refresh that reached the disk.
        atomic_write_json(self._layout.writer_status_path(self.writer_id), record, durable=False)


def publish_groups(
    spool_dir: Path | str, groups: Sequence[Sequence[Sample]], writer_id: str | None = None
) -> list[Path]:
    """One-shot publish (tests, scripts); a rollout loop keeps a ``ShardWriter`` instead."""
    return ShardWriter(
        spool_dir, writer_id, shard_max_samples=max(1, sum(map(len, groups)))
    ).publish(groups)


# --- backpressure ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backlog:
    """What waits in ``ready/`` for the trainer, from file names alone (no file opens)."""

    num_ready_shards: int
    num_ready_groups: int
    num_ready_samples: int
    oldest_policy_version: int | None  # None when nothing is ready
    oldest_created_unix_s: float | None


def backlog(spool_dir: Path | str) -> Backlog:
    names = [ShardName.parse(n) for n in list_names(SpoolLayout(Path(spool_dir)).ready_dir)]
    shards = [n for n in names if n is not None]
    return Backlog(
        num_ready_shards=len(shards),
        num_ready_groups=sum(s.num_groups for s in shards),
        num_ready_samples=sum(s.num_samples for s in shards),
        oldest_policy_version=min((s.min_policy_version for s in shards), default=None),
        oldest_created_unix_s=min((s.created_unix_s for s in shards), default=None),
    )


def wait_for_room(
    spool_dir: Path | str,
    max_ready_groups: int,
    poll_s: float = 0.5,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Backlog:
    """Block while ``ready/`` holds ``max_ready_groups`` or more groups (-1: never block)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        current = backlog(spool_dir)
        if max_ready_groups < 0 or current.num_ready_groups < max_ready_groups:
            return current
        if deadline is not None and time.monotonic() >= deadline:
            raise SpoolTimeout(
                f"spool still holds {current.num_ready_groups} ready groups "
                f"(limit {max_ready_groups}) after {timeout_s} s"
            )
        sleep(poll_s)
