"""The spool's inner layout under ``RunPaths.spool_dir``, shard names, and safe renames.

    spool/
      tmp/         shards being written: <final name>.<host>.<pid>.<token>.tmp
      ready/       published shards, final names only; writers rename into it
      claimed/     shards the trainer claimed: c<claim seq>-<shard name>
      consumed/    consumed shards kept for debugging (``keep_consumed``)
      quarantine/  bad shards + <name>.reason.json
      writers/     <writer_id>.json: per-writer publish counters (status CLI)
      redo/        stale-dropped groups to generate again (``spool.redo``)
      reader.json  the trainer side's counters and recent throughput (status CLI; rewritten
                   at most once a second and at every checkpoint)

A shard name carries what listings need, so backpressure and ``status`` are a directory
listing, never a file open (slow on network filesystems):

    <created unix ms, 13 digits>-<writer_id>-<seq, 6 digits>-<token>-v<min policy_version>-g<groups>-s<samples>.h5

Names sort by publish time, are unique across writers (writer id, per-process sequence,
random token) and contain no characters that need quoting. Only the writer creates files in
``ready/``; only the single consumer (trainer rank 0) moves them out. Must not: read shard
contents or hold any state.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

SHARD_SUFFIX = ".h5"
TMP_SUFFIX = ".tmp"
REASON_SUFFIX = ".reason.json"
_WRITER_ID = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
_SHARD = re.compile(
    r"^(?P<created_ms>\d{13})-(?P<writer_id>[A-Za-z0-9_.]{1,64})-(?P<seq>\d{6,})-(?P<token>[0-9a-f]{8})"
    r"-v(?P<min_policy_version>\d+)-g(?P<num_groups>\d+)-s(?P<num_samples>\d+)\.h5$"
)
_CLAIMED = re.compile(r"^c(?P<claim_seq>\d{10})-(?P<shard>.+)$")
_TMP = re.compile(r"^(?P<final>.+)\.(?P<pid>\d+)\.(?P<token>[0-9a-f]+)\.tmp$")


def check_writer_id(writer_id: str) -> str:
    if not _WRITER_ID.match(writer_id):
        raise ValueError(f"writer_id {writer_id!r} must match {_WRITER_ID.pattern}")
    return writer_id


def default_writer_id() -> str:
    """``<host>.<pid>`` with characters outside the allowed set replaced by ``_``."""
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40]
    return f"{host}.{os.getpid()}"


@dataclass(frozen=True)
class ShardName:
    """The parsed name of a shard file (the name in ``ready/``, without claim prefix)."""

    created_ms: int
    writer_id: str
    seq: int
    token: str
    min_policy_version: int
    num_groups: int
    num_samples: int

    @property
    def name(self) -> str:
        return (
            f"{self.created_ms:013d}-{self.writer_id}-{self.seq:06d}-{self.token}"
            f"-v{self.min_policy_version}-g{self.num_groups}-s{self.num_samples}{SHARD_SUFFIX}"
        )

    @property
    def created_unix_s(self) -> float:
        return self.created_ms / 1000.0

    @classmethod
    def parse(cls, name: str) -> ShardName | None:
        """The parsed name, or None when ``name`` is not a shard name."""
        match = _SHARD.match(name)
        if match is None:
            return None
        fields = match.groupdict()
        token = fields.pop("token")
        writer_id = fields.pop("writer_id")
        return cls(token=token, writer_id=writer_id, **{k: int(v) for k, v in fields.items()})


def claimed_name(claim_seq: int, shard_name: str) -> str:
    return f"c{claim_seq:010d}-{shard_name}"


def parse_claimed(name: str) -> tuple[int, ShardName] | None:
    """``(claim_seq, shard name)`` of a file in ``claimed/``, or None if it is not one."""
    match = _CLAIMED.match(name)
    if match is None:
        return None
    shard = ShardName.parse(match["shard"])
    return None if shard is None else (int(match["claim_seq"]), shard)


def original_name(name: str) -> str:
    """The shard name without a claim prefix (for requeue and display)."""
    match = _CLAIMED.match(name)
    return match["shard"] if match else name


def tmp_writer_pid(name: str, host: str) -> int | None:
    """The pid of the process on ``host`` writing temp file ``name``; None when ``name`` is
    not ``<final name>.<host>.<pid>.<token>.tmp`` of that host.

    Every temp file in a spool has that shape: shards in ``tmp/`` (``ShardWriter``) and JSON
    files beside their targets (``paths.atomic_write_json``: status files, quarantine
    reasons). Final names and host names both contain dots, so the host is matched against
    the one given, never parsed out of the name.
    """
    match = _TMP.match(name)
    if match is None or not match["final"].endswith(f".{host}"):
        return None
    return int(match["pid"])


@dataclass(frozen=True)
class SpoolLayout:
    """Paths inside one spool directory; ``create`` makes the folders."""

    spool_dir: Path

    @property
    def tmp_dir(self) -> Path:
        return self.spool_dir / "tmp"

    @property
    def ready_dir(self) -> Path:
        return self.spool_dir / "ready"

    @property
    def claimed_dir(self) -> Path:
        return self.spool_dir / "claimed"

    @property
    def consumed_dir(self) -> Path:
        return self.spool_dir / "consumed"

    @property
    def quarantine_dir(self) -> Path:
        return self.spool_dir / "quarantine"

    @property
    def writers_dir(self) -> Path:
        return self.spool_dir / "writers"

    @property
    def redo_dir(self) -> Path:
        return self.spool_dir / "redo"

    @property
    def reader_status_path(self) -> Path:
        return self.spool_dir / "reader.json"

    def writer_status_path(self, writer_id: str) -> Path:
        return self.writers_dir / f"{writer_id}.json"

    @property
    def folders(self) -> tuple[Path, ...]:
        return (
            self.tmp_dir,
            self.ready_dir,
            self.claimed_dir,
            self.consumed_dir,
            self.quarantine_dir,
            self.writers_dir,
        )

    def create(self) -> SpoolLayout:
        for folder in self.folders:
            folder.mkdir(parents=True, exist_ok=True)
        return self


def list_names(directory: Path, suffix: str = SHARD_SUFFIX) -> list[str]:
    """Sorted names in ``directory`` ending in ``suffix``; a missing directory is empty."""
    try:
        with os.scandir(directory) as entries:
            return sorted(e.name for e in entries if e.name.endswith(suffix))
    except FileNotFoundError:
        return []


def rename_once(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst``; False if ``src`` is gone and ``dst`` was not created by us.

    On NFS a retransmitted RENAME can fail with ENOENT although the first attempt
    succeeded, so ENOENT with ``dst`` present counts as success. The caller must be the
    only process moving ``src`` (the spool's single consumer, or the writer of a temp).
    """
    try:
        os.rename(src, dst)
        return True
    except FileNotFoundError:
        return dst.exists() and not src.exists()
