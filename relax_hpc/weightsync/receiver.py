"""The rollout-engine side of weight sync: join, attend rounds, verify, switch, fail closed.

A rollout loop calls ``poll_for_update(load_fn)`` between generation batches (at least
every ``timeout_s``, or the trainer drops the engine and it re-registers). The call
attends the newest round addressed to this engine (see ``sender`` for the keys),
receives the buckets into staging buffers, verifies the signed manifest and digest and
every bucket checksum, and only then calls ``load_fn(named_tensors)`` and switches
``current_policy_version``. Samples must be stamped with ``current_policy_version``.

Liveness: once admitted, the receiver holds a proven TCP connection to the trainer
(``liveness``) that its kernel closes when the process dies, so the trainer never waits
out a timeout for a dead engine. While it waits in a round (group formation, buckets) it
watches the round's signed digest and gives up at once when the trainer aborted the
round (another member died): it reports ``transport`` and is served by the retry round,
never left waiting for a peer that is gone.

A trainer that restarts: when the trainer's store stops answering (its process died), the
receiver keeps its loaded weights and its version, forgets the group and its liveness
connection, and at each later poll looks for the ``trainer.json`` of a new trainer start
(another ``instance``); it then joins that one as a new member and is admitted and caught
up by it like any joiner. The rollout process, its engine and its model stay as they are.

Fail closed: a payload that fails verification (or a ``load_fn`` that raises) leaves the
engine with ``ready_to_generate == False`` until a verified version arrives, by a later
round or from ``weights/v{N}/``; the rollout loop must not generate meanwhile. A transport
failure (the trainer or a peer died mid-broadcast) never touches the loaded weights, so
the engine keeps serving its current, known version and waits for the trainer's retry.

Must not: import the trainer side; keep staging tensors alive beyond the next poll (the
tensors handed to ``load_fn`` are views into buffers reused by the next round).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from relax_hpc.config.weightsync import WeightSyncConfig
from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import fs_export, liveness, protocol, rendezvous
from relax_hpc.weightsync.errors import (
    WeightSyncError,
    WeightSyncRefused,
    WeightSyncTimeout,
    WeightVerificationError,
)
from relax_hpc.weightsync.group import (
    AbortCheck,
    PeerGroup,
    has_key,
    open_store,
    wait_for_key,
)

log = logging.getLogger(__name__)

LoadFn = Callable[[Mapping[str, torch.Tensor]], None]
LIVENESS_RETRY_S = 5.0  # a failed liveness connection is tried again after this long
REJOIN_RETRY_S = 0.5  # how often a receiver that lost its trainer looks for the next one


@dataclass
class WeightUpdate:
    """A verified set of weights, already handed to ``load_fn``."""

    policy_version: int
    num_bytes: int
    seconds: float
    source: str  # "network" | "filesystem"


def module_loader(module: torch.nn.Module) -> LoadFn:
    """A ``load_fn`` that copies every received tensor into ``module`` (names must match)."""
    state = module.state_dict()

    def load(tensors: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(tensors) - set(state))
        if missing:
            raise KeyError(f"received tensors the model does not have: {missing[:5]}")
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].copy_(tensor)

    return load


class WeightReceiver:
    """Receives versioned weights from the trainer into one rollout engine."""

    def __init__(
        self,
        paths: RunPaths,
        engine_id: str,
        config: WeightSyncConfig,
        device: str | torch.device = "cpu",
        token: str | None = None,
        initial_policy_version: int | None = None,
        attempt: str = "",
    ) -> None:
        """``token`` overrides the one read from ``trainer.json`` (tests, external engines);
        ``initial_policy_version`` declares weights already loaded (e.g. 0 for the base model);
        ``attempt`` (the job start, ``TaskIdentity.attempt``) makes ``join`` wait for the
        trainer of the same start.
        """
        self.attempt = attempt
        self.paths = paths
        self.engine_id = engine_id
        self.config = config.validate()
        self.device = torch.device(device)
        self._token_override = token
        self._token = ""
        self._version = initial_policy_version
        self._fail_closed_reason: str | None = None
        self._store = None
        self._endpoint: rendezvous.TrainerEndpoint | None = None
        self._registration: rendezvous.EngineRegistration | None = None
        self._admitted = False
        self._liveness: socket.socket | None = None
        self._liveness_tried_s = -LIVENESS_RETRY_S
        self._lost_instance: str | None = None  # the trainer start whose store went away
        self._rejoin_tried_s = -REJOIN_RETRY_S
        self._last_round = 0
        self._group: PeerGroup | None = None
        self._staging: list[torch.Tensor] = []

    # --- state the rollout loop reads ---------------------------------------------------------
    @property
    def current_policy_version(self) -> int | None:
        return self._version

    @property
    def ready_to_generate(self) -> bool:
        """False until a verified version is loaded, and after a failed verification."""
        return self._version is not None and self._fail_closed_reason is None

    @property
    def fail_closed_reason(self) -> str | None:
        return self._fail_closed_reason

    # --- lifecycle -----------------------------------------------------------------------------
    def join(self, load_fn: LoadFn | None = None) -> None:
        """Find the trainer, load the latest published weights (if ``load_fn``), register."""
        endpoint = rendezvous.wait_for_trainer_endpoint(
            self.paths, self.config.timeout_s, self.config.poll_s, self.attempt
        )
        if load_fn is not None:
            self.load_latest_from_filesystem(load_fn)
        self._connect(endpoint)

    def _connect(self, endpoint: rendezvous.TrainerEndpoint) -> None:
        """Open ``endpoint``'s store and register with that trainer start."""
        self._token = self._token_override or endpoint.token
        self._store = open_store(endpoint.host, endpoint.port, False, self.config.timeout_s)
        self._endpoint = endpoint
        self._liveness_tried_s = -LIVENESS_RETRY_S
        self._last_round = self._store.add("round", 0)  # rounds before joining are not ours
        self._register(endpoint.instance)

    @property
    def trainer_lost(self) -> bool:
        """The trainer's store stopped answering and no new trainer start was found yet."""
        return self._lost_instance is not None

    def close(self) -> None:
        self._unregister()
        if self._group is not None:
            self._group.close()
        self._group = None
        self._store = None

    def _unregister(self) -> None:
        """Remove this process's registration file and its liveness connection."""
        if self._registration is not None:
            rendezvous.deregister_engine(self.paths, self._registration)
        if self._liveness is not None:
            self._liveness.close()
        self._liveness = None

    def _register(self, trainer_instance: str) -> None:
        self._unregister()  # a join retried or a re-registration leaves no stale file
        self._registration = rendezvous.EngineRegistration(
            engine_id=self.engine_id,
            incarnation=rendezvous.new_nonce(),
            trainer_instance=trainer_instance,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        member = self._registration.member_id
        # the hello is in the store before the file that makes the trainer look for it
        self._store.set(f"hello/{member}", rendezvous.hello_proof(self._token, member))
        rendezvous.register_engine(self.paths, self._registration)
        self._admitted = False
        log.info("weightsync: engine %s registered as %s", self.engine_id, member)

    @property
    def _member(self) -> str:
        assert self._registration is not None, "call join() first"
        return self._registration.member_id

    # --- polling -------------------------------------------------------------------------------
    def poll_for_update(self, load_fn: LoadFn, wait_s: float = 0.0) -> WeightUpdate | None:
        """Attend a pending round, waiting up to ``wait_s`` for one; None if nothing new.

        Raises ``WeightSyncRefused`` when the trainer refused this engine's token.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._reconnected() and self._check_admission():
                    current = self._store.add("round", 0)
                    if current > self._last_round:
                        self._last_round = current
                        update, retry_expected = self._attend(current, load_fn)
                        if update is not None:
                            return update
                        if retry_expected:
                            deadline = max(deadline, time.monotonic() + self.config.timeout_s)
                        continue
            except (RuntimeError, OSError) as error:
                if self._store_answers():
                    raise  # not the trainer's loss: a load_fn's or this engine's own error
                self._lose_trainer(error)
            if self._fail_closed_reason is not None and self.config.fs_fallback:
                update = self.load_latest_from_filesystem(load_fn)
                if update is not None:
                    return update
            if time.monotonic() >= deadline:
                return None
            self._pause(min(self.config.poll_s, max(deadline - time.monotonic(), 0.0)))

    # --- a trainer that restarts ------------------------------------------------------------
    def _store_answers(self) -> bool:
        try:
            self._store.check(["round"])
            return True
        except (RuntimeError, OSError):
            return False

    def _lose_trainer(self, error: Exception) -> None:
        """The trainer's store is gone: keep the weights, wait for its next start."""
        self._lost_instance = self._endpoint.instance if self._endpoint else ""
        log.warning("weightsync: engine %s lost the trainer (%s); keeping policy_version %s "
                    "and waiting for the trainer's next start", self.engine_id,
                    str(error).splitlines()[0][:200], self._version)  # fmt: skip
        self._forget_group()
        self._unregister()
        self._store = None
        self._admitted = False

    def _reconnected(self) -> bool:
        """True while connected; after a loss, joins a new trainer start once one published
        its endpoint (looked for every ``REJOIN_RETRY_S``)."""
        if self._lost_instance is None:
            return True
        now = time.monotonic()
        if now - self._rejoin_tried_s < REJOIN_RETRY_S:
            return False
        self._rejoin_tried_s = now
        endpoint = rendezvous.read_trainer_endpoint(self.paths)
        if endpoint is None or endpoint.instance == self._lost_instance:
            return False
        try:
            self._connect(endpoint)
        except (RuntimeError, OSError) as error:  # that start died too: wait for the next
            log.info("weightsync: trainer start %s not reachable: %s", endpoint.instance, error)
            self._store = None
            return False
        log.info("weightsync: engine %s rejoined the trainer's new start %s (keeps "
                 "policy_version %s until it sends one)", self.engine_id, endpoint.instance,
                 self._version)  # fmt: skip
        self._lost_instance = None
        return True

    def nudge_trainer(self) -> None:
        """Wake the trainer now (it waits for samples or a message of this engine); a no-op
        without a liveness connection, where it finds them at its next poll."""
        if self._liveness is not None:
            liveness.nudge(self._liveness)

    def _pause(self, timeout_s: float) -> None:
        """Until the trainer nudges (a round called) or ``timeout_s``: the nudge wakes this
        engine within a round trip; without a liveness connection it is a plain poll."""
        if self._liveness is None:
            time.sleep(timeout_s)
            return
        try:
            liveness.wait_for_nudge(self._liveness, timeout_s)
        except (ConnectionError, OSError, ValueError):
            # the trainer closed it (it is leaving or restarting): poll until it is back
            self._liveness.close()
            self._liveness = None

    def _check_admission(self) -> bool:
        """True when admitted; re-registers after being dropped; raises when refused."""
        member = self._member
        if self._admitted:
            notice = self._drop_notice(member)
            if notice is None:
                self._ensure_liveness()
                return True
            log.warning("weightsync: the trainer dropped %s (%s); registering again",
                        member, notice["reason"])  # fmt: skip
            self._forget_group()
            self._register(self._registration.trainer_instance)
            return False
        if not has_key(self._store, f"admission/{member}"):
            return False
        answer = json.loads(self._store.get(f"admission/{member}"))
        if not answer["ok"]:
            rendezvous.deregister_engine(self.paths, self._registration)
            raise WeightSyncRefused(f"trainer refused engine {member}: {answer['reason']}")
        if not rendezvous.verify_signature(
            self._token, f"admit|{member}".encode(), answer["proof"]
        ):
            raise WeightSyncRefused(
                f"engine {member} refuses the trainer: its admission proof does not match this "
                "run's token (stale rendezvous file, or another run's trainer on that port)"
            )
        self._admitted = True
        log.info("weightsync: engine %s admitted", member)
        self._ensure_liveness()
        return True

    def _drop_notice(self, member: str) -> dict | None:
        """The trainer's signed notice that it dropped ``member``; a forged one is ignored."""
        key = f"dropped/{member}"
        if not has_key(self._store, key):
            return None
        notice = rendezvous.open_message(self._token, self._store.get(key), member=member)
        if notice is None:
            log.warning("weightsync: ignoring an unsigned drop notice for %s", member)
        return notice

    def _ensure_liveness(self) -> None:
        """Hold a proven liveness connection to the trainer (retried while it fails)."""
        port = self._endpoint.liveness_port if self._endpoint else 0
        now = time.monotonic()
        if (
            self._liveness is not None
            or not port
            or now - self._liveness_tried_s < LIVENESS_RETRY_S
        ):
            return
        self._liveness_tried_s = now
        try:
            self._liveness = liveness.connect(
                self._endpoint.host, port, self._token, self._member, self.config.timeout_s
            )
        except OSError as error:
            log.warning("weightsync: no liveness connection to the trainer yet: %s", error)

    def _attend(self, r: int, load_fn: LoadFn) -> tuple[WeightUpdate | None, bool]:
        """Take part in round ``r``; returns (update, whether the trainer will retry us)."""
        call_value = self._store.get(f"r/{r}/call")  # set before the round counter
        call = rendezvous.open_message(self._token, call_value, round=r)
        if call is None or self._member not in call["candidates"]:
            return None, False
        start = time.monotonic()
        self._send_message(r, "ready", value=self._ready_value())
        try:
            # the trainer waits up to timeout_s for every candidate before it writes the plan
            plan = self._read_signed(f"r/{r}/plan", 2 * self.config.timeout_s)
            self._check_plan(r, plan)
        except WeightSyncTimeout as error:
            return self._transport_failed(r, str(error))
        except WeightVerificationError as error:
            self._reject(r, str(error))
            return None, False
        if self._member not in plan["members"]:
            return None, False
        manifest = protocol.Manifest.from_json(plan["manifest"])
        return self._take_part(r, plan, manifest, load_fn, start)

    # --- seams of a round, for other transports (weightsync.per_tensor) ----------------------
    def _ready_value(self) -> str:
        """What this receiver tells the trainer when it is ready for a round."""
        return "1"

    def _check_plan(self, r: int, plan: dict) -> None:
        """Raise ``WeightVerificationError`` for a plan this receiver cannot follow."""

    def _take_part(
        self, r: int, plan: dict, manifest: protocol.Manifest, load_fn: LoadFn, start: float
    ) -> tuple[WeightUpdate | None, bool]:
        """Receive, verify and switch to ``manifest``'s version (the bucket transport)."""
        try:
            checksums = self._receive(plan, manifest)
            digest = self._read_signed(f"r/{r}/digest")
        except WeightVerificationError as error:  # a digest not signed by the trainer
            self._reject(r, str(error))
            return None, False
        except (RuntimeError, WeightSyncError) as error:
            return self._transport_failed(r, str(error))
        if "abort" in digest:
            return self._transport_failed(r, f"trainer aborted the round: {digest['abort']}")
        try:
            self._verify(manifest, checksums, digest)
        except WeightVerificationError as error:
            self._reject(r, str(error))
            return None, False
        update = self._switch(manifest, load_fn, start)
        self._report(r, "ok", "")
        return update, False

    def _receive(self, plan: dict, manifest: protocol.Manifest) -> list[int]:
        """Receive every bucket (two in flight), checksumming each as it lands."""
        group = self._group_for(plan)
        aborted = self._round_abort_check(manifest.round)
        buffers = self._staging_for(manifest.layout)
        checksums: list[int] = []
        in_flight = []
        for buffer in buffers:
            in_flight.append(group.broadcast(buffer))
            if len(in_flight) == 2:
                self._complete(group, in_flight.pop(0), manifest.checksum_algo, checksums, aborted)
        while in_flight:
            self._complete(group, in_flight.pop(0), manifest.checksum_algo, checksums, aborted)
        return checksums

    def _complete(
        self, group: PeerGroup, work, algo: str, checksums: list[int], aborted: AbortCheck
    ) -> None:
        group.wait(work, aborted)
        bucket = len(checksums)  # buckets complete in order
        self._on_bucket_received(bucket)
        checksums.append(protocol.bucket_checksum(self._staging[bucket], algo))

    def _on_bucket_received(self, bucket: int) -> None:
        """Seam for fault-injection tests (die mid-broadcast)."""

    def _verify(self, manifest: protocol.Manifest, checksums: list[int], digest: dict) -> None:
        if digest.get("round") != manifest.round:
            raise WeightVerificationError(
                f"digest of round {digest.get('round')} for round {manifest.round}"
            )
        bad = [
            b
            for b, (got, want) in enumerate(zip(checksums, digest["checksums"], strict=True))
            if got != want
        ]
        if bad:
            raise WeightVerificationError(
                f"checksum mismatch in bucket(s) {bad} of policy_version {manifest.policy_version}"
            )

    def _switch(self, manifest: protocol.Manifest, load_fn: LoadFn, start: float) -> WeightUpdate:
        tensors = protocol.unpack(self._staging, manifest.layout)
        try:
            load_fn(tensors)
        except Exception as error:
            self._fail_closed(
                f"load_fn failed on policy_version {manifest.policy_version}: {error}"
            )
            raise
        self._version = manifest.policy_version
        self._fail_closed_reason = None
        seconds = time.monotonic() - start
        # DEBUG: the caller logs the version it loaded (rollout/weights.py, throttled)
        log.debug(
            "weightsync: engine %s switched to policy_version %d", self.engine_id, self._version
        )
        return WeightUpdate(self._version, manifest.layout.total_nbytes, seconds, "network")

    # --- filesystem ----------------------------------------------------------------------------
    def load_latest_from_filesystem(self, load_fn: LoadFn) -> WeightUpdate | None:
        """Load ``weights/v{N}/`` if it is newer than the current version (verified)."""
        latest = fs_export.latest_published_version(self.paths)
        if latest is None or (self._version is not None and latest <= self._version):
            return None
        start = time.monotonic()
        try:
            version, tensors = fs_export.load_published_weights(self.paths, latest, self.device)
        except (FileNotFoundError, WeightVerificationError) as error:
            log.warning("weightsync: cannot load published weights v%d: %s", latest, error)
            return None
        try:
            load_fn(tensors)
        except Exception as error:
            self._fail_closed(f"load_fn failed on published policy_version {version}: {error}")
            raise
        self._version = version
        self._fail_closed_reason = None
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        log.info(
            "weightsync: engine %s loaded published policy_version %d", self.engine_id, version
        )
        return WeightUpdate(version, num_bytes, time.monotonic() - start, "filesystem")

    # --- helpers -------------------------------------------------------------------------------
    def _read_signed(self, key: str, timeout_s: float | None = None) -> dict:
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        message = json.loads(wait_for_key(self._store, key, timeout_s))
        body = message["body"]
        if not rendezvous.verify_signature(
            self._token, protocol.canonical_bytes(body), message["sig"]
        ):
            raise WeightVerificationError(f"bad signature on {key}: not from this run's trainer")
        return body

    def _group_for(self, plan: dict) -> PeerGroup:
        if self._group is not None and self._group.generation == plan["generation"]:
            return self._group
        if self._group is not None:
            self._group.close()
            self._group = None
        rank = plan["members"].index(self._member) + 1
        self._group = PeerGroup(
            self._connect_store, plan["generation"], rank, len(plan["members"]) + 1,
            plan["backend"], self.device, self.config.timeout_s,
            self._round_abort_check(plan["manifest"]["round"]),
        )  # fmt: skip
        return self._group

    def _connect_store(self):
        """A new client of the trainer's store, for a group forming on another thread."""
        assert self._endpoint is not None
        host, port = self._endpoint.host, self._endpoint.port
        return open_store(host, port, False, self.config.timeout_s)

    def _round_abort_check(self, r: int) -> AbortCheck:
        """An ``AbortCheck`` that names the trainer's signed abort of round ``r``."""
        key = f"r/{r}/digest"

        def check() -> str | None:
            if not has_key(self._store, key):
                return None
            digest = rendezvous.open_message(self._token, self._store.get(key), round=r)
            if digest is None or "abort" not in digest:
                return None
            return f"the trainer gave up round {r}: {digest['abort']}"

        return check

    def _forget_group(self) -> None:
        """Give up the group; its staging buffers too, which its abandoned work may still
        be writing into."""
        if self._group is not None:
            self._group.abandon()
            self._staging = []
        self._group = None

    def _staging_for(self, layout: protocol.Layout) -> list[torch.Tensor]:
        sizes = [buffer.numel() for buffer in self._staging]
        if sizes != list(layout.bucket_nbytes):
            self._staging = [
                torch.zeros(n, dtype=torch.uint8, device=self.device) for n in layout.bucket_nbytes
            ]
        return self._staging

    def _transport_failed(self, r: int, error: str) -> tuple[None, bool]:
        log.warning("weightsync: engine %s round %d transport failed: %s", self.engine_id, r, error)
        self._forget_group()
        self._report(r, "transport", error)
        return None, True

    def _reject(self, r: int, error: str) -> None:
        self._fail_closed(error)
        self._report(r, "verify", error)

    def _fail_closed(self, reason: str) -> None:
        self._fail_closed_reason = reason
        log.error("weightsync: engine %s FAIL-CLOSED (keeps policy_version %s, stops generating): %s",
                  self.engine_id, self._version, reason)  # fmt: skip

    def _report(self, r: int, outcome: str, error: str) -> None:
        self._send_message(
            r, "result", outcome=outcome, error=error[:500], policy_version=self._version
        )

    def _send_message(self, r: int, kind: str, **fields) -> None:
        """``r/<r>/<kind>/<member>``, signed, naming its round and member."""
        body = {"round": r, "member": self._member, "msg": kind, **fields}
        self._store.set(f"r/{r}/{kind}/{self._member}", rendezvous.sign_message(self._token, body))
        self.nudge_trainer()  # the trainer is waiting for it
