"""The exceptions of weight sync: things an operator can act on, not internal bugs."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """Base class; a failed sync never leaves a receiver on weights of unknown version."""


class WeightSyncTimeout(WeightSyncError):
    """A bounded wait (store key, collective, file) ran out."""


class WeightSyncAborted(WeightSyncError):
    """A round was given up before it finished (a peer died, or the trainer aborted it)."""


class WeightSyncRefused(WeightSyncError):
    """The trainer refused this engine (wrong token), or the engine refused the trainer."""


class WeightVerificationError(WeightSyncError):
    """A payload or manifest failed its checksum or signature; the old weights were kept."""
