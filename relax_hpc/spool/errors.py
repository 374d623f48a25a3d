"""The spool's exception family.

``SpoolError`` and its subclasses are for things a user or operator can fix (a shard
written by newer code, a corrupt file, a wrong argument); ``assert`` guards internal
invariants. Must not: import anything but the standard library.
"""

from __future__ import annotations


class SpoolError(Exception):
    """A spool problem a user or operator can fix; the message names what and how."""


class ShardCorruptError(SpoolError):
    """A shard is truncated, unreadable or violates the schema; the reader quarantines it."""


class ShardVersionError(SpoolError):
    """A shard was written with a newer schema version than this code can read.

    Raised only for a header whose checksum holds (a damaged version is corruption). Not
    quarantined: the shard is fine, the reading code is too old. The trainer stops with
    this error as a configuration error (once, no restart) so that nothing is dropped;
    upgrade relax_hpc on the reading side.
    """


class SpoolTimeout(TimeoutError):
    """``next_batch`` did not gather enough groups in time; nothing was consumed."""
