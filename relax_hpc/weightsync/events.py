"""Lifecycle events of weight sync: ``observe/events.py``'s one-file-per-event record.

Event names: ``weightsync_peer_dropped``, ``weightsync_peer_refused``,
``weightsync_verification_failed``, ``weightsync_fs_fallback``.
"""

from __future__ import annotations

from relax_hpc.observe.events import emit_event

__all__ = ["emit_event"]
