"""The trainer side of weight sync: admission, rounds, bucketed broadcast, fallback.

``WeightSender`` runs on the trainer rank that holds the full (gathered) weights, rank 0.
One call of ``sync`` is one or two *rounds* (the second only to retry survivors after a
transport failure). The store keys of round ``r`` (all under ``relax_hpc/weightsync/``):

1. ``r/<r>/call``: the candidates (admitted engines); then the counter ``round`` := r.
2. ``r/<r>/ready/<member>``: each candidate that is polling says it is ready. Candidates
   not ready within ``timeout_s`` are dropped (``dropped/<member>`` is set; a live engine
   re-registers and is admitted again at a later sync).
3. ``r/<r>/plan`` (signed): members, generation, backend and the manifest (see
   ``protocol``). The group of that generation is reused while members do not change.
4. The buckets, broadcast from rank 0; then ``r/<r>/digest`` (signed): bucket checksums,
   or ``abort`` when the trainer's side of the broadcast failed.
5. ``r/<r>/result/<member>``: ``ok`` (switched to the new version), ``verify`` (rejected
   the payload, kept its old weights), ``transport`` (its collective failed; it waits for
   a retry round). Members without a result within the time bound are dropped.

Every phase is bounded by ``timeout_s`` (a result after a transport failure by
``min(timeout_s, FAILURE_GRACE_S)``), so ``sync`` returns in a bounded time whatever the
engines do. Dropped and refused peers are logged and written as events.

Must not: import the rollout side, or call ``init_process_group``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax_hpc.config.weightsync import WeightSyncConfig
from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import fs_export, protocol, rendezvous
from relax_hpc.weightsync.errors import WeightSyncTimeout
from relax_hpc.weightsync.events import emit_event
from relax_hpc.weightsync.group import (
    PeerGroup,
    has_key,
    open_store,
    resolve_backend,
    store_port,
    wire_device,
)

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 5.0
MAX_ROUNDS_PER_SYNC = 2


@dataclass
class SyncReport:
    """What one ``sync`` achieved; engine ids, not member ids, in the lists."""

    policy_version: int
    members: list[str] = field(default_factory=list)  # switched to policy_version
    failed: list[str] = field(default_factory=list)  # rejected the payload (verification)
    dropped: list[str] = field(default_factory=list)  # timed out or died; left the group
    refused: list[str] = field(default_factory=list)  # presented a wrong token
    num_bytes: int = 0  # payload bytes sent per receiver in the last round
    seconds: float = 0.0  # whole sync, including waiting for the engines to load
    broadcast_seconds: float = 0.0  # group formation excluded: pack + send of the last round
    generation: int | None = None
    rounds: int = 0
    published_dir: str | None = None


def signed(token: str, body: dict) -> str:
    return json.dumps({"body": body, "sig": rendezvous.sign(token, protocol.canonical_bytes(body))})


class WeightSender:
    """Pushes new weights from the trainer to every admitted rollout engine."""

    def __init__(
        self,
        paths: RunPaths,
        config: WeightSyncConfig,
        device: str | torch.device = "cpu",
        attempt: str = "",  # the job start (TaskIdentity.attempt), written into trainer.json
    ) -> None:
        self.paths = paths
        self.attempt = attempt
        self.config = config.validate()
        self.backend = resolve_backend(config.backend, torch.device(device))
        self.device = wire_device(self.backend, torch.device(device))  # buffers and groups
        self.serve_dtype = protocol.parse_serve_dtype(config.serve_dtype)
        self._store = None
        self._token = ""
        self._instance = ""
        self._admitted: dict[str, rendezvous.EngineRegistration] = {}
        self._refused: set[str] = set()
        self._dropped: set[str] = set()  # a dropped engine comes back as a new incarnation
        self._round = 0
        self._generation = 0
        self._group: PeerGroup | None = None
        self._group_members: list[str] = []
        self._buffers: list[torch.Tensor] = []
        self._layout_key: tuple = ()
        self._layout: protocol.Layout | None = None
        self._num_syncs = 0
        self._round_candidates: dict[int, list[str]] = {}

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> rendezvous.TrainerEndpoint:
        """Open the store and publish ``trainer.json`` (0600); keeps a requeued run's token."""
        host = self.config.advertise_host or rendezvous.default_host()
        self._store = open_store(host, self.config.port, True, self.config.timeout_s)
        self._token = rendezvous.existing_token(self.paths) or rendezvous.new_token()
        self._instance = rendezvous.new_nonce()
        endpoint = rendezvous.TrainerEndpoint(
            host, store_port(self._store), self._token, self._instance, os.getpid(), self.attempt
        )
        rendezvous.publish_trainer_endpoint(self.paths, endpoint)
        log.info("weightsync: trainer store at %s:%d (%s)", host, endpoint.port, self.backend)
        return endpoint

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
        self._store = None

    @property
    def admitted_engines(self) -> list[str]:
        return sorted(reg.engine_id for reg in self._admitted.values())

    # --- admission ---------------------------------------------------------------------------
    def admit_pending(self) -> tuple[list[str], list[str]]:
        """Admit or refuse newly registered engines; return (admitted, refused) engine ids."""
        assert self._store is not None, "call start() first"
        current = {
            reg.member_id: reg
            for reg in rendezvous.list_engine_registrations(self.paths)
            if reg.trainer_instance == self._instance
        }
        for member in [m for m in self._admitted if m not in current]:
            log.info("weightsync: engine %s left (deregistered)", member)
            del self._admitted[member]
        admitted, refused = [], []
        for member, reg in current.items():
            if member in self._admitted or member in self._refused or member in self._dropped:
                continue
            if self._admit(member, reg):
                admitted.append(reg.engine_id)
            else:
                refused.append(reg.engine_id)
        return admitted, refused

    def _admit(self, member: str, reg: rendezvous.EngineRegistration) -> bool:
        hello_key = f"hello/{member}"
        proof = self._store.get(hello_key).decode() if has_key(self._store, hello_key) else ""
        if proof and rendezvous.verify_signature(self._token, f"hello|{member}".encode(), proof):
            answer = {"ok": True, "proof": rendezvous.admit_proof(self._token, member)}
            self._store.set(f"admission/{member}", json.dumps(answer))
            self._admitted[member] = reg
            log.info("weightsync: admitted engine %s (host %s)", member, reg.host)
            return True
        reason = "token mismatch: the engine did not present this run's token"
        self._store.set(f"admission/{member}", json.dumps({"ok": False, "reason": reason}))
        self._refused.add(member)
        log.error(
            "weightsync: REFUSED engine %s (host %s, pid %d): %s", member, reg.host, reg.pid, reason
        )
        emit_event(
            self.paths,
            "weightsync_peer_refused",
            engine_id=reg.engine_id,
            member=member,
            host=reg.host,
            reason=reason,
        )
        return False

    # --- sync ----------------------------------------------------------------------------------
    def sync(self, named_tensors: protocol.NamedTensors, policy_version: int) -> SyncReport:
        """Send ``named_tensors`` as ``policy_version`` to every admitted engine (bounded)."""
        start = time.monotonic()
        report = SyncReport(policy_version)
        _, report.refused = self.admit_pending()
        named = protocol.as_named_list(named_tensors)
        layout = self._layout_for(named)
        tensors = dict(named)
        candidates = sorted(self._admitted)
        while candidates and report.rounds < MAX_ROUNDS_PER_SYNC:
            candidates = self._run_round(candidates, tensors, layout, report)
        self._num_syncs += 1
        if self._should_publish(report):
            report.published_dir = str(self.publish_to_filesystem(named, policy_version))
        report.seconds = time.monotonic() - start
        log.info(
            "weightsync: policy_version %d -> %d engines in %.3f s (%d bytes; failed %s, dropped %s)",
            policy_version,
            len(report.members),
            report.seconds,
            report.num_bytes,
            report.failed,
            report.dropped,
        )
        return report

    def _should_publish(self, report: SyncReport) -> bool:
        every = self.config.fs_every_syncs
        if every and self._num_syncs % every == 0:
            return True
        trouble = not report.members or report.failed or report.dropped
        if self.config.fs_fallback and trouble:
            emit_event(
                self.paths,
                "weightsync_fs_fallback",
                policy_version=report.policy_version,
                failed=report.failed,
                dropped=report.dropped,
            )
            return True
        return False

    def publish_to_filesystem(
        self, named_tensors: protocol.NamedTensors, policy_version: int
    ) -> Path:
        """Export ``weights/v{policy_version}/`` (serving dtype) for joiners and fallback."""
        return fs_export.publish_weights(
            self.paths,
            named_tensors,
            policy_version,
            self.serve_dtype,
            self.config.fs_keep_versions,
        )

    def _run_round(
        self,
        candidates: list[str],
        tensors: dict[str, torch.Tensor],
        layout: protocol.Layout,
        report: SyncReport,
    ) -> list[str]:
        """One round; returns the members to retry (their collective failed, they are alive)."""
        r = self._open_round(candidates)
        report.rounds += 1
        ready = self._await_keys([f"r/{r}/ready/{m}" for m in candidates], self.config.timeout_s)
        members = [m for m, key in zip(candidates, ready, strict=True) if key]
        for member in sorted(set(candidates) - set(members)):
            self._drop(member, r, f"not ready within {self.config.timeout_s:.1f} s", report)
        members = self._eligible(r, members, report)
        manifest = protocol.Manifest(report.policy_version, r, self._checksum_algo(), layout)
        generation = self._generation_for(members)
        plan = {
            "members": members,
            "generation": generation,
            "backend": self.backend,
            "manifest": manifest.to_json(),
            **self._plan_extras(generation, members),
        }
        self._store.set(f"r/{r}/plan", self._sign(plan))
        if not members:
            return []
        transport_ok = self._send(r, generation, members, tensors, layout, report)
        return self._collect_results(r, members, transport_ok, report)

    # --- seams of the round, for other transports (weightsync.per_tensor) ----------------------
    def _eligible(self, r: int, members: list[str], report: SyncReport) -> list[str]:
        """The ready members this transport can serve (the others are dropped)."""
        return members

    def _plan_extras(self, generation: int, members: list[str]) -> dict:
        """Transport-specific entries of the signed plan."""
        return {}

    def _sign(self, body: dict) -> str:
        return signed(self._token, body)

    def _collect_results(
        self, r: int, members: list[str], transport_ok: bool, report: SyncReport
    ) -> list[str]:
        """Each member's result of round ``r``; returns the members to retry."""
        grace = (
            self.config.timeout_s if transport_ok else min(self.config.timeout_s, FAILURE_GRACE_S)
        )
        keys = [f"r/{r}/result/{m}" for m in members]
        present = self._await_keys(keys, grace)
        num_dropped_before = len(report.dropped)
        retry = []
        for member, key, has_result in zip(members, keys, present, strict=True):
            if not has_result:
                self._drop(member, r, f"no result within {grace:.1f} s (died or hung)", report)
                continue
            result = json.loads(self._store.get(key))
            retry += self._classify(member, result, report)
        if retry or not transport_ok or len(report.dropped) > num_dropped_before:
            self._abandon_group()  # some member left this generation's group mid-round
        self._forget_round(r - 2)
        return retry

    def _send(self, r: int, generation: int, members: list[str], tensors, layout, report) -> bool:
        try:
            group = self._group_for(generation, members)
            start = time.monotonic()
            checksums = self._broadcast(group, tensors, layout)
            report.broadcast_seconds = time.monotonic() - start
            report.num_bytes = layout.total_nbytes
            report.generation = generation
            self._store.set(
                f"r/{r}/digest", signed(self._token, {"round": r, "checksums": checksums})
            )
            return True
        except (RuntimeError, WeightSyncTimeout) as error:
            log.warning(
                "weightsync: round %d broadcast failed (generation %d): %s", r, generation, error
            )
            self._abandon_group()
            self._store.set(
                f"r/{r}/digest", signed(self._token, {"round": r, "abort": str(error)[:500]})
            )
            return False

    def _classify(self, member: str, result: dict, report: SyncReport) -> list[str]:
        engine_id = self._admitted[member].engine_id
        if result["kind"] == "ok":
            report.members.append(engine_id)
        elif result["kind"] == "transport":
            return [member]
        else:
            report.failed.append(engine_id)
            log.error(
                "weightsync: engine %s rejected policy_version %d: %s",
                member,
                report.policy_version,
                result.get("error"),
            )
            emit_event(
                self.paths,
                "weightsync_verification_failed",
                engine_id=engine_id,
                member=member,
                policy_version=report.policy_version,
                error=result.get("error"),
            )
        return []

    def _broadcast(
        self, group: PeerGroup, tensors: dict[str, torch.Tensor], layout: protocol.Layout
    ) -> list[int]:
        """Pack bucket k (and checksum it) while bucket k-1 is on the wire; two buffers."""
        buffers = self._send_buffers(layout)
        in_flight = [None, None]
        checksums = []
        algo = self._checksum_algo()
        for bucket, nbytes in enumerate(layout.bucket_nbytes):
            slot = bucket % 2
            if in_flight[slot] is not None:
                group.wait(in_flight[slot])
            buffer = buffers[slot][:nbytes]
            protocol.pack_bucket(buffer, layout.buckets[bucket], tensors)
            checksums.append(protocol.bucket_checksum(buffer, algo))
            self._before_send(bucket, buffer)
            in_flight[slot] = group.broadcast(buffer)
        for work in in_flight:
            if work is not None:
                group.wait(work)
        return checksums

    def _before_send(self, bucket: int, buffer: torch.Tensor) -> None:
        """Seam for fault-injection tests (corrupt a bucket after its checksum)."""

    # --- helpers -------------------------------------------------------------------------------
    def _open_round(self, candidates: list[str]) -> int:
        self._round += 1
        self._store.set(f"r/{self._round}/call", json.dumps({"candidates": candidates}))
        self._round_candidates[self._round] = list(candidates)
        counter = self._store.add("round", 1)
        assert counter == self._round, f"round counter {counter} != {self._round}: two trainers?"
        return self._round

    def _await_keys(self, keys: list[str], timeout_s: float) -> list[bool]:
        """Which of ``keys`` exist, waiting until all do or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        present = [False] * len(keys)
        while True:
            present = [
                ok or has_key(self._store, key) for ok, key in zip(present, keys, strict=True)
            ]
            if all(present) or time.monotonic() >= deadline:
                return present
            time.sleep(self.config.poll_s)

    def _drop(self, member: str, r: int, reason: str, report: SyncReport) -> None:
        reg = self._admitted.pop(member)
        self._dropped.add(member)
        report.dropped.append(reg.engine_id)
        self._store.set(f"dropped/{member}", reason)
        log.error(
            "weightsync: DROPPED engine %s (host %s, pid %d) in round %d, policy_version %d: %s",
            member,
            reg.host,
            reg.pid,
            r,
            report.policy_version,
            reason,
        )
        emit_event(
            self.paths,
            "weightsync_peer_dropped",
            engine_id=reg.engine_id,
            member=member,
            host=reg.host,
            round=r,
            policy_version=report.policy_version,
            reason=reason,
        )

    def _generation_for(self, members: list[str]) -> int:
        if self._group is None or members != self._group_members:
            if self._group is not None:
                self._group.close()
                self._group = None
            self._generation += 1
        return self._generation

    def _group_for(self, generation: int, members: list[str]) -> PeerGroup:
        if self._group is None:
            self._group = PeerGroup(
                self._store,
                generation,
                0,
                len(members) + 1,
                self.backend,
                self.device,
                self.config.timeout_s,
            )
            self._group_members = list(members)
        assert self._group.generation == generation
        return self._group

    def _abandon_group(self) -> None:
        if self._group is not None:
            self._group.abandon()
        self._group = None

    def _checksum_algo(self) -> str:
        return protocol.checksum_algo_for(self.device)

    def _layout_for(self, named: list[tuple[str, torch.Tensor]]) -> protocol.Layout:
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in named)
        if key != self._layout_key:
            self._layout = protocol.plan_layout(
                named, self.config.bucket_mb << 20, self.serve_dtype
            )
            self._layout_key = key
        return self._layout

    def _send_buffers(self, layout: protocol.Layout) -> list[torch.Tensor]:
        """Two flat buffers of the largest bucket, reused across syncs."""
        need = max(layout.bucket_nbytes)
        if not self._buffers or self._buffers[0].numel() < need:
            self._buffers = [
                torch.zeros(need, dtype=torch.uint8, device=self.device) for _ in range(2)
            ]
        return self._buffers

    def _forget_round(self, r: int) -> None:
        """Delete the small keys of an old round so the store does not grow with the run."""
        if r < 1:
            return
        members = self._round_candidates.pop(r, [])
        keys = [f"r/{r}/call", f"r/{r}/plan", f"r/{r}/digest"]
        keys += [f"r/{r}/{kind}/{m}" for m in members for kind in ("ready", "result")]
        for key in keys:
            self._store.delete_key(key)
