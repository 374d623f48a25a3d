"""The trainer side of weight sync: rounds, bucketed broadcast, fallback.

``WeightSender`` runs on the trainer rank that holds the full (gathered) weights, rank 0;
which engines take part is ``admission``'s decision. One call of ``sync`` is one or two
*rounds* (the second only to retry survivors after a transport failure). The store keys
of round ``r`` (all under ``relax_hpc/weightsync/``), every value signed with the run
token and naming its round and member (``rendezvous.sign_message``):

1. ``r/<r>/call``: the candidates (admitted engines); then the counter ``round`` := r.
2. ``r/<r>/ready/<member>``: each candidate that is polling says it is ready. Candidates
   not ready within ``timeout_s`` (one whose liveness connection is open, possibly busy
   generating: within the bound ``busy`` derives from recent step times) are dropped
   (``dropped/<member>`` is set; a live engine re-registers and is admitted again at a
   later sync, or as a joiner while the trainer waits for samples).
3. ``r/<r>/plan``: members, generation, backend and the manifest (see ``protocol``). The
   group of that generation is reused while members do not change.
4. The buckets, broadcast from rank 0; then ``r/<r>/digest``: bucket checksums, or
   ``abort`` when the trainer gave up the group (formation or broadcast failed, or a
   member died). Receivers watch for it while they wait, so none is left waiting.
5. ``r/<r>/result/<member>``: ``ok`` (switched to the new version), ``verify`` (rejected
   the payload, kept its old weights), ``transport`` (its collective failed; it waits for
   a retry round). Members without a result within the time bound are dropped.

Time bounds. A member whose process dies is seen at once through its liveness connection
(``liveness``): no phase waits for it, the group is given up (``digest`` = abort), the
survivors report ``transport`` within a ``WAIT_SLICE_S`` and are served by the retry
round. A death therefore costs one extra round, not a timeout. Without that signal (a
hung engine, a lost node, an engine without a liveness connection) each phase waits at
most ``timeout_s``: ready, formation, each bucket, results; after a given-up group the
results of members not connected for liveness are awaited ``min(timeout_s,
FAILURE_GRACE_S)`` (connected ones, alive by definition, get ``timeout_s``). So a sync
in which engines die returns within ``timeout_s + FAILURE_GRACE_S`` plus the cost of its
retry round; when the dead are processes that held a liveness connection (a crash, a
kill, the OOM killer: the kernel closes their sockets), within its retry round plus a few
``WAIT_SLICE_S``: no timeout is waited out. A healthy engine is never dropped for
another's death. tests/dist/test_weightsync_receiver_death.py asserts both bounds.
Dropped and refused peers are logged and written as events.

Must not: import the rollout side, or call ``init_process_group``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relax_hpc.config.weightsync import WeightSyncConfig
from relax_hpc.observe.metrics import LogThrottle
from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import fs_export, protocol, rendezvous
from relax_hpc.weightsync.admission import Admission
from relax_hpc.weightsync.busy import BusyBound
from relax_hpc.weightsync.errors import WeightSyncError
from relax_hpc.weightsync.events import emit_event
from relax_hpc.weightsync.group import (
    AbortCheck,
    PeerGroup,
    has_key,
    open_store,
    resolve_backend,
    store_port,
    wire_device,
)
from relax_hpc.weightsync.liveness import LivenessMonitor

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


class WeightSender:
    """Pushes new weights from the trainer to every admitted rollout engine."""

    def __init__(
        self,
        paths: RunPaths,
        config: WeightSyncConfig,
        device: str | torch.device = "cpu",
        attempt: str = "",  # the job start (TaskIdentity.attempt), written into trainer.json
        trainer_pid: int | None = None,  # trainer.json's pid: the trainer's (default: ours)
    ) -> None:
        self.paths = paths
        self.attempt = attempt
        self.trainer_pid = os.getpid() if trainer_pid is None else trainer_pid
        self.config = config.validate()
        self.backend = resolve_backend(config.backend, torch.device(device))
        self.device = wire_device(self.backend, torch.device(device))  # buffers and groups
        self.serve_dtype = protocol.parse_serve_dtype(config.serve_dtype)
        self._store = None
        self._host = ""
        self._token = ""
        self._instance = ""
        self._liveness: LivenessMonitor | None = None
        self._admission: Admission | None = None
        self._ready: dict[str, dict] = {}  # the verified ready messages of the current round
        self._round = 0
        self._generation = 0
        self._group: PeerGroup | None = None
        self._group_members: list[str] = []
        self._buffers: list[torch.Tensor] = []
        self._layout_key: tuple = ()
        self._layout: protocol.Layout | None = None
        self._num_syncs = 0
        self._busy = BusyBound(
            self.config.busy_steps, self.config.busy_floor_s, self.config.busy_timeout_s
        )
        self._round_candidates: dict[int, list[str]] = {}
        # "policy_version N -> M engines": the first 10 syncs, then 1 a second, and every
        # sync that failed, dropped or served joiners (a line per ~40 ms step cost the send
        # process's core, the rollout's, ~0.4 ms a step)
        self._log_lines = LogThrottle()

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> rendezvous.TrainerEndpoint:
        """Open the store and publish ``trainer.json`` (0600); keeps a requeued run's token."""
        host = self._host = self.config.advertise_host or rendezvous.default_host()
        self._store = open_store(host, self.config.port, True, self.config.timeout_s)
        self._token = rendezvous.existing_token(self.paths) or rendezvous.new_token()
        self._instance = rendezvous.new_nonce()
        self._liveness = self._start_liveness(host)
        self._admission = Admission(
            self.paths, self._store, self._token, self._instance, self._liveness
        )
        endpoint = rendezvous.TrainerEndpoint(
            host,
            store_port(self._store),
            self._token,
            self._instance,
            self.trainer_pid,
            self.attempt,
            self._liveness.port if self._liveness else 0,
        )
        rendezvous.publish_trainer_endpoint(self.paths, endpoint)
        log.info("weightsync: trainer store at %s:%d (%s)", host, endpoint.port, self.backend)
        return endpoint

    def _start_liveness(self, host: str) -> LivenessMonitor | None:
        try:
            return LivenessMonitor(host, self._token)
        except OSError as error:
            log.warning(
                "weightsync: no liveness port on %s (%s): a dead engine is then noticed only "
                "through timeouts (weightsync.timeout_s)",
                host,
                error,
            )
            return None

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
        if self._liveness is not None:
            self._liveness.close()
        self._liveness = None
        self._store = None

    @property
    def admitted_engines(self) -> list[str]:
        admitted = self._admission.admitted.values() if self._admission else []
        return sorted(reg.engine_id for reg in admitted)

    @property
    def _admitted(self) -> dict[str, rendezvous.EngineRegistration]:
        return self._admission.admitted

    # --- admission ---------------------------------------------------------------------------
    def admit_pending(self) -> tuple[list[str], list[str]]:
        """Admit or refuse newly registered engines; return (admitted, refused) engine ids."""
        assert self._admission is not None, "call start() first"
        return self._admission.admit_pending()

    def admit_joiners(self) -> list[str]:
        """Admit new registrations now; return the members admitted by this call."""
        before = set(self._admitted)
        self.admit_pending()
        return sorted(set(self._admitted) - before)

    # --- sync ----------------------------------------------------------------------------------
    def sync(
        self,
        named_tensors: protocol.NamedTensors,
        policy_version: int,
        only: list[str] | None = None,
    ) -> SyncReport:
        """Send ``named_tensors`` as ``policy_version`` to every admitted engine (bounded), or
        to the admitted members in ``only`` (joiners catching up with the current version)."""
        start = time.monotonic()
        report = SyncReport(policy_version)
        if only is None:
            self._busy.sync_started()
            _, report.refused = self.admit_pending()
        named = protocol.as_named_list(named_tensors)
        layout = self._layout_for(named)
        tensors = dict(named)
        candidates = sorted(m for m in self._admitted if only is None or m in only)
        while candidates and report.rounds < MAX_ROUNDS_PER_SYNC:
            candidates = self._run_round(candidates, tensors, layout, report)
        self._num_syncs += 1
        if only is None:
            self._busy.sync_ended()
        if self._should_publish(report):
            report.published_dir = str(self.publish_to_filesystem(named, policy_version))
        report.seconds = time.monotonic() - start
        unusual = only is not None or not report.members or report.failed or report.dropped
        if not self._log_lines.due(force=bool(unusual)):
            return report  # every round's figures are in the trainer's TensorBoard run
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
        called = time.monotonic()
        ready = self._await_messages(
            r, "ready", candidates, self.config.timeout_s, self._busy.seconds()
        )
        if all(body is not None for body in ready.values()):  # how long busy engines take
            self._busy.answered(time.monotonic() - called)
        self._ready = {m: body for m, body in ready.items() if body is not None}
        members = [m for m in candidates if m in self._ready and not self._admission.is_dead(m)]
        for member in sorted(set(candidates) - set(members)):
            self._drop(member, r, self._silence(member, "ready", self._ready_bound(member)), report)
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

    def _sign(self, plan: dict) -> str:
        """The signed plan (a seam: tests forge it)."""
        return rendezvous.sign_message(self._token, plan)

    def _collect_results(
        self, r: int, members: list[str], transport_ok: bool, report: SyncReport
    ) -> list[str]:
        """Each member's result of round ``r``; returns the members to retry."""
        timeout_s = self.config.timeout_s
        grace = timeout_s if transport_ok else min(timeout_s, FAILURE_GRACE_S)
        results = self._await_messages(r, "result", members, grace, connected_timeout_s=timeout_s)
        num_dropped_before = len(report.dropped)
        retry = []
        for member in members:
            result = results[member]
            if result is None:
                self._drop(member, r, self._silence(member, "result", grace), report)
                continue
            retry += self._classify(member, result, report)
        if retry or not transport_ok or len(report.dropped) > num_dropped_before:
            self._abandon_group()  # some member left this generation's group mid-round
        self._forget_round(r - 2)
        return retry

    def _send(self, r: int, generation: int, members: list[str], tensors, layout, report) -> bool:
        peer_lost = self._peer_loss_check(members)
        try:
            group = self._group_for(generation, members, peer_lost)
            start = time.monotonic()
            checksums = self._broadcast(group, tensors, layout, peer_lost)
            report.broadcast_seconds = time.monotonic() - start
            report.num_bytes = layout.total_nbytes
            report.generation = generation
            self._store.set(
                f"r/{r}/digest",
                rendezvous.sign_message(self._token, {"round": r, "checksums": checksums}),
            )
            return True
        except (RuntimeError, WeightSyncError) as error:
            log.warning(
                "weightsync: round %d broadcast failed (generation %d): %s", r, generation, error
            )
            self._abandon_group()
            self._store.set(
                f"r/{r}/digest",
                rendezvous.sign_message(self._token, {"round": r, "abort": str(error)[:500]}),
            )
            return False

    def _peer_loss_check(self, members: list[str]) -> AbortCheck:
        """An ``AbortCheck`` naming the first of ``members`` whose process died."""

        def check() -> str | None:
            dead = [m for m in members if self._admission.is_dead(m)]
            return f"engine {dead[0]} died (its liveness connection closed)" if dead else None

        return check

    def _classify(self, member: str, result: dict, report: SyncReport) -> list[str]:
        engine_id = self._admitted[member].engine_id
        if result.get("outcome") == "ok":
            report.members.append(engine_id)
        elif result.get("outcome") == "transport":
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
        self,
        group: PeerGroup,
        tensors: dict[str, torch.Tensor],
        layout: protocol.Layout,
        peer_lost: AbortCheck,
    ) -> list[int]:
        """Pack bucket k (and checksum it) while bucket k-1 is on the wire; two buffers."""
        buffers = self._send_buffers(layout)
        in_flight = [None, None]
        checksums = []
        algo = self._checksum_algo()
        for bucket, nbytes in enumerate(layout.bucket_nbytes):
            slot = bucket % 2
            if in_flight[slot] is not None:
                group.wait(in_flight[slot], peer_lost)
            buffer = buffers[slot][:nbytes]
            protocol.pack_bucket(buffer, layout.buckets[bucket], tensors)
            checksums.append(protocol.bucket_checksum(buffer, algo))
            self._before_send(bucket, buffer)
            in_flight[slot] = group.broadcast(buffer)
        for work in in_flight:
            if work is not None:
                group.wait(work, peer_lost)
        return checksums

    def _before_send(self, bucket: int, buffer: torch.Tensor) -> None:
        """Seam for fault-injection tests (corrupt a bucket after its checksum)."""

    # --- helpers -------------------------------------------------------------------------------
    def _open_round(self, candidates: list[str]) -> int:
        self._round += 1
        call = rendezvous.sign_message(
            self._token, {"round": self._round, "candidates": candidates}
        )
        self._store.set(f"r/{self._round}/call", call)
        self._round_candidates[self._round] = list(candidates)
        counter = self._store.add("round", 1)
        assert counter == self._round, f"round counter {counter} != {self._round}: two trainers?"
        if self._liveness is not None:
            self._liveness.nudge_all()  # engines waiting for a round look now, not at a poll
        return self._round

    def _await_messages(
        self,
        r: int,
        kind: str,
        members: list[str],
        timeout_s: float,
        connected_timeout_s: float | None = None,
    ) -> dict[str, dict | None]:
        """Each member's verified ``r/<r>/<kind>/<member>`` message; None for a member whose
        process died (known at once) or that sent nothing verifiable within ``timeout_s``
        (``connected_timeout_s`` for one whose liveness connection is open)."""
        start = time.monotonic()
        got: dict[str, dict | None] = {}
        while len(got) < len(members):
            waited_s = time.monotonic() - start
            for member in [m for m in members if m not in got]:
                key = f"r/{r}/{kind}/{member}"
                if has_key(self._store, key):
                    expected = {"round": r, "member": member, "msg": kind}
                    body = rendezvous.open_message(self._token, self._store.get(key), **expected)
                    if body is not None:
                        got[member] = body
                        continue
                limit_s = timeout_s
                if connected_timeout_s is not None and self._admission.is_connected(member):
                    limit_s = connected_timeout_s
                if self._admission.is_dead(member) or waited_s >= limit_s:
                    got[member] = None
            if len(got) < len(members):
                self._pause()
        return got

    def _pause(self) -> None:
        """Until an engine nudges (it wrote a message) or ``poll_s``."""
        self.wait_for_engines(self.config.poll_s)

    def wait_for_engines(self, timeout_s: float) -> bool:
        """Until an engine nudges (a message, or samples it published) or ``timeout_s``: the
        trainer's wait between two looks at the store or the spool; whether one nudged. A
        plain sleep without the liveness monitor."""
        if self._liveness is None:
            time.sleep(timeout_s)
            return False
        return self._liveness.wait_for_nudge(timeout_s)

    def _ready_bound(self, member: str) -> float:
        """How long ``member`` may take to answer a call: busy generating when it is alive,
        for as long as the recent steps say a chunk takes (``busy``)."""
        if self._admission.is_connected(member):
            return self._busy.seconds()
        return self.config.timeout_s

    def _silence(self, member: str, kind: str, timeout_s: float) -> str:
        """Why ``member`` sent no ``kind`` message."""
        if self._admission.is_dead(member):
            return f"its process died (liveness connection closed) before its {kind}"
        return f"no {kind} within {timeout_s:.1f} s (hung or unreachable)"

    def _drop(self, member: str, r: int, reason: str, report: SyncReport) -> None:
        fields = {"round": r, "policy_version": report.policy_version}
        reg = self._admission.drop(member, f"round {r}: {reason}", **fields)
        report.dropped.append(reg.engine_id)

    def _generation_for(self, members: list[str]) -> int:
        if self._group is None or members != self._group_members:
            if self._group is not None:
                self._group.close()
                self._group = None
            self._generation += 1
        return self._generation

    def _group_for(
        self, generation: int, members: list[str], should_abort: AbortCheck
    ) -> PeerGroup:
        """The group of ``generation`` with ``members``, formed on first use."""
        if self._group is None:
            self._group = self._new_group(generation, members, should_abort)
            self._group_members = list(members)
        assert self._group.generation == generation
        return self._group

    def _new_group(
        self, generation: int, members: list[str], should_abort: AbortCheck
    ) -> PeerGroup:
        """This sender's kind of group: rank 0 of a group over the trainer's own store."""
        return PeerGroup(
            self._connect_store,
            generation,
            0,
            len(members) + 1,
            self.backend,
            self.device,
            self.config.timeout_s,
            should_abort,
        )

    def _connect_store(self):
        """A new client of the trainer's own store, for a group forming on another thread."""
        return open_store(self._host, store_port(self._store), False, self.config.timeout_s)

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
