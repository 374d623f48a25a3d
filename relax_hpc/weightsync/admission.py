"""Which engines take part in syncs: admission before identity, refusals, drops.

An engine process is a *member* (``<engine_id>.<incarnation>``). A new registration of
this trainer start is judged in two steps, the second only for what passed the first:

1. proof: its hello (``hello/<member>`` in the store) is the token's HMAC over its member
   id; anything else is refused: a wrong token, another member's proof replayed, a
   truncated or missing hello.
2. identity: no admitted member with the same engine id is alive; a second proven engine
   with a live engine's id is refused as a duplicate (two engines configured alike). One
   whose process is gone (``liveness``) is dropped and the newcomer takes its place.

Refusing changes nothing else: registrations are files keyed by the whole member id,
refusals are remembered per member id, and an admitted member leaves only when its file
is gone and its liveness connection closed (it deregistered and closed, or died), a round
drops it, or a proven newcomer replaces it after its death. Every
refusal and drop is logged and written as an event. Must not: run rounds or form groups.
"""

from __future__ import annotations

import json
import logging

from torch._C._distributed_c10d import Store

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import rendezvous
from relax_hpc.weightsync.events import emit_event
from relax_hpc.weightsync.group import has_key
from relax_hpc.weightsync.liveness import LivenessMonitor

log = logging.getLogger(__name__)

WRONG_TOKEN = "token mismatch: the engine did not present this run's token"


class Admission:
    """The admitted, refused and dropped members of one trainer start."""

    def __init__(
        self,
        paths: RunPaths,
        store: Store,
        token: str,
        instance: str,
        liveness: LivenessMonitor | None,
    ) -> None:
        self.paths = paths
        self._store = store
        self._token = token
        self._instance = instance
        self._liveness = liveness
        self.admitted: dict[str, rendezvous.EngineRegistration] = {}
        self._refused: set[str] = set()
        self._dropped: set[str] = set()  # a dropped engine comes back as a new incarnation

    def is_dead(self, member: str) -> bool:
        """Its process is gone: its liveness connection closed."""
        return self._liveness is not None and self._liveness.is_dead(member)

    def is_connected(self, member: str) -> bool:
        return self._liveness is not None and self._liveness.is_connected(member)

    def admit_pending(self) -> tuple[list[str], list[str]]:
        """Judge new registrations; return the engine ids (admitted, refused) this call."""
        current = {
            reg.member_id: reg
            for reg in rendezvous.list_engine_registrations(self.paths)
            if reg.trainer_instance == self._instance
        }
        for member in [m for m in self.admitted if m not in current]:
            if self.is_connected(member):  # alive: someone else removed its file
                continue
            log.info("weightsync: engine %s left (deregistered)", member)
            del self.admitted[member]
        admitted, refused = [], []
        for member, reg in current.items():
            if member in self.admitted or member in self._refused or member in self._dropped:
                continue
            reason = self._refusal(member, reg)
            if reason is None:
                self._admit(member, reg)
                admitted.append(reg.engine_id)
            else:
                self._refuse(member, reg, reason)
                refused.append(reg.engine_id)
        return admitted, refused

    def drop(self, member: str, reason: str, **event_fields) -> rendezvous.EngineRegistration:
        """Remove an admitted member; a live engine sees the signed notice and registers anew."""
        reg = self.admitted.pop(member)
        self._dropped.add(member)
        notice = {"member": member, "reason": reason}
        self._store.set(f"dropped/{member}", rendezvous.sign_message(self._token, notice))
        self._announce("DROPPED", "weightsync_peer_dropped", reg, reason, **event_fields)
        return reg

    def _refusal(self, member: str, reg: rendezvous.EngineRegistration) -> str | None:
        """Why ``member`` is refused (proof first, identity second), or None to admit it."""
        hello_key = f"hello/{member}"
        proof = ""
        if has_key(self._store, hello_key):
            proof = self._store.get(hello_key).decode(errors="replace")
        if not rendezvous.verify_signature(self._token, f"hello|{member}".encode(), proof):
            return WRONG_TOKEN
        for other, other_reg in list(self.admitted.items()):
            if other_reg.engine_id != reg.engine_id:
                continue
            if not self.is_dead(other):
                return (
                    f"duplicate engine id: {reg.engine_id!r} is in use by the live engine "
                    f"{other} (host {other_reg.host}, pid {other_reg.pid}); give every "
                    "engine its own id"
                )
            self.drop(other, f"replaced by {member}: its process is gone")
        return None

    def _admit(self, member: str, reg: rendezvous.EngineRegistration) -> None:
        answer = {"ok": True, "proof": rendezvous.admit_proof(self._token, member)}
        self._store.set(f"admission/{member}", json.dumps(answer))
        self.admitted[member] = reg
        log.info("weightsync: admitted engine %s (host %s)", member, reg.host)

    def _refuse(self, member: str, reg: rendezvous.EngineRegistration, reason: str) -> None:
        self._store.set(f"admission/{member}", json.dumps({"ok": False, "reason": reason}))
        self._refused.add(member)
        self._announce("REFUSED", "weightsync_peer_refused", reg, reason)

    def _announce(
        self, verb: str, event: str, reg: rendezvous.EngineRegistration, reason: str, **fields
    ) -> None:
        """Log an error line and write the event an operator's alerts read."""
        log.error("weightsync: %s engine %s (host %s, pid %d): %s",
                  verb, reg.member_id, reg.host, reg.pid, reason)  # fmt: skip
        emit_event(
            self.paths,
            event,
            engine_id=reg.engine_id,
            member=reg.member_id,
            host=reg.host,
            reason=reason,
            **fields,
        )
