"""Per-tensor transport (``weightsync.transport=sglang_distributed``): one broadcast per tensor.

SGLang's distributed weight update (``init_weights_update_group`` and
``update_weights_from_distributed``, read in SGLang 0.5.6's engine and model runner) has
every tensor-parallel worker of an engine join a process group whose rank 0 is the trainer,
then receive each tensor of a list into ``torch.empty(shape, dtype)`` by one broadcast from
rank 0, in list order, and load them. This module is the trainer's end of that group plus
the small signed coordination around it. ``PerTensorSender``/``PerTensorReceiver`` subclass
``WeightSender``/``WeightReceiver`` and keep their admission, drops, results, retry round
and filesystem fallback; a round runs as in ``sender``, except:

- ``r/<r>/ready/<member>`` carries ``{"num_ranks": n}``: how many workers the engine adds.
- ``r/<r>/plan`` (signed) also has ``transport`` and ``group``: ``master_address``,
  ``master_port``, ``group_name``, ``world_size`` (1 + the workers of every member) and
  ``rank_offsets`` (the first rank of each member; SGLang adds its tp_rank). The manifest's
  tensor list (name, dtype, shape, in order) is what the engine asks SGLang to receive;
  its bucket fields are unused here.
- The data: each tensor, converted to the serving dtype, broadcast from rank 0.
- ``r/<r>/digest`` (signed): one checksum per tensor, computed by the trainer.

The group. A new membership (a *generation*) gets a fresh TCPStore on a free port and the
group name ``relax_hpc_weights_<trainer instance>_<generation>`` (SGLang refuses to reuse
a name). SGLang's workers meet through ``tcp://`` rendezvous (rank 0 hosts the store), wrap
it in ``PrefixStore(group_name)`` and build the backend with torch's
``_new_process_group_helper``, which nests ``PrefixStore(group_name + "/")`` and
``PrefixStore(device + "/")`` (``cpu`` for Gloo, ``cuda`` for NCCL) and then calls the
backend's ``_set_sequence_number_for_group``. The trainer builds its backend directly on
the same key layout (no ``init_process_group``, no global registry, so the trainer's own
default group is never split or touched) and reuses ``PeerGroup``'s bounded wait/abort.
tests/dist/test_weightsync_per_tensor.py checks that layout against torch's helper.

What is verified: the plan and digest signatures (a manifest not signed with the run token
is refused before SGLang is told anything); SGLang's success reply; and, where the engine
can read back what it received (the CPU stand-in of the tests), every tensor's checksum.
SGLang itself offers no checksum of loaded weights (its ``get_weights_by_name`` returns a
truncated, TP-sharded, possibly fused view), so for a real SGLang engine its success reply
is the verification; ``policy_version`` is stamped only after it.

Bounded in time on the trainer as in ``sender`` for Gloo. With NCCL the communicator forms
inside the first broadcast (SGLang's workers create it lazily too), a blocking NCCL call
that only torch's watchdog bounds if a worker never arrives: unverified, as is all of the
NCCL path (no GPU in CI). On the engine side SGLang's group uses its own timeout
(torch's default, 30 min in 0.5.6; the API takes none), so an engine whose trainer died
mid-broadcast may block inside SGLang that long.

Must not: import sglang or the rollout side; call ``init_process_group``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore

from relax_hpc.config.weightsync import WeightSyncConfig
from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import protocol, rendezvous
from relax_hpc.weightsync.errors import (
    WeightSyncError,
    WeightVerificationError,
)
from relax_hpc.weightsync.group import AbortCheck, PeerGroup, form_on_thread
from relax_hpc.weightsync.receiver import LoadFn, WeightReceiver, WeightUpdate
from relax_hpc.weightsync.sender import SyncReport, WeightSender

log = logging.getLogger(__name__)

TRANSPORT = "sglang_distributed"
GROUP_NAME_PREFIX = "relax_hpc_weights"


# --- the engine's side, as the receiver sees it ------------------------------------------------
@dataclass(frozen=True)
class GroupEndpoint:
    """What one engine needs to join a generation's group (SGLang's argument names)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


class PerTensorEngine(Protocol):
    """An engine that receives tensors itself (SGLang; the tests' stand-in)."""

    num_ranks: int  # processes it adds to the group (SGLang: its tensor-parallel size)

    def join_group(self, endpoint: GroupEndpoint) -> None:
        """Join the group; returns once this engine's ranks are members. Raises on failure."""

    def receive(self, specs: list[protocol.TensorSpec]) -> None:
        """Receive ``specs`` in order (one broadcast each) and load them. Raises on failure."""

    def verify(self, specs: list[protocol.TensorSpec], checksums: list[int], algo: str) -> None:
        """Raise ``WeightVerificationError`` if what was loaded does not match ``checksums``;
        an engine that cannot read its weights back accepts (see the module docstring)."""

    def leave_group(self, group_name: str) -> None:
        """Forget a group (failed or replaced); must not raise."""


def tensor_checksum(tensor: torch.Tensor, algo: str) -> int:
    """``protocol``'s checksum of one tensor's bytes (zero-padded to whole 32-bit words)."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if algo == protocol.CHECKSUM_WSUM64:
        padded = torch.nn.functional.pad(data, (0, -data.numel() % 4))
        return protocol._wsum64(padded.view(torch.int32))
    return protocol.host_checksum(data.cpu().numpy(), algo)


# --- the trainer's end of the group ---------------------------------------------------------------
def sglang_group_store(rendezvous_store: Store, group_name: str, backend: str) -> Store:
    """The store namespace the backend of SGLang's group uses (see the module docstring)."""
    device_type = "cuda" if backend == "nccl" else "cpu"
    named = PrefixStore(group_name, rendezvous_store)
    return PrefixStore(f"{device_type}/", PrefixStore(f"{group_name}/", named))


class SGLangGroupRoot(PeerGroup):
    """Rank 0 of a group that SGLang's workers form with ``init_custom_process_group``.

    Reuses ``PeerGroup``'s broadcast/wait/abandon/close; only the construction differs
    (SGLang's key layout instead of ours), so ``PeerGroup.__init__`` is not called.
    """

    def __init__(
        self,
        rendezvous_store: TCPStore,
        group_name: str,
        generation: int,
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
        should_abort: AbortCheck,
    ) -> None:
        self.generation = generation
        self.rank = 0
        self.world_size = world_size
        self.backend_name = backend
        self.device = device
        self.timeout_s = timeout_s
        self._pending = []
        self._rendezvous_store = rendezvous_store  # NCCL reads its unique id from it lazily
        store = sglang_group_store(rendezvous_store, group_name, backend)
        timeout = timedelta(seconds=timeout_s)

        def make():  # on a thread: the main thread keeps watching for dead engines
            if backend == "gloo":
                backend_object = ProcessGroupGloo(store, 0, world_size, timeout)  # waits for peers
            else:
                from torch._C._distributed_c10d import ProcessGroupNCCL

                options = ProcessGroupNCCL.Options()
                options.is_high_priority_stream = False
                options._timeout = timeout
                # no eager connect: SGLang's workers form the communicator at their first
                # broadcast
                backend_object = ProcessGroupNCCL(store, 0, world_size, options)
            # as torch's helper does on every rank, so both ends of the group start alike
            backend_object._set_sequence_number_for_group()
            return backend_object

        self._backend = form_on_thread(make, timeout_s, should_abort, group_name)


@dataclass
class _GroupPlan:
    generation: int
    group: dict  # the plan's "group" entry
    store: TCPStore


class PerTensorSender(WeightSender):
    """``WeightSender`` for ``transport=sglang_distributed``; same calls (start/sync/close)."""

    def __init__(
        self,
        paths: RunPaths,
        config: WeightSyncConfig,
        device: str | torch.device = "cpu",
        attempt: str = "",
    ) -> None:
        if config.transport != TRANSPORT:
            raise ValueError(f"PerTensorSender needs weightsync.transport={TRANSPORT!r}")
        super().__init__(paths, config, device, attempt)
        self._group_plan: _GroupPlan | None = None
        self._num_ranks: dict[str, int | None] = {}

    def close(self) -> None:
        super().close()
        self._group_plan = None

    def _eligible(self, r: int, members: list[str], report: SyncReport) -> list[str]:
        """Members whose receiver is on this transport; their worker counts are kept."""
        self._num_ranks = {m: self._ready_ranks(r, m) for m in members}
        for member in members:
            if self._num_ranks[member] is None:
                reason = f"its receiver is not on weightsync.transport={TRANSPORT}"
                self._drop(member, r, reason, report)
        return [m for m in members if self._num_ranks[m] is not None]

    def _plan_extras(self, generation: int, members: list[str]) -> dict:
        plan = self._group_plan_for(generation, members, self._num_ranks) if members else None
        return {"transport": TRANSPORT, "group": plan.group if plan else None}

    def _send(self, r: int, generation: int, members: list[str], tensors, layout, report) -> bool:
        transport_ok = super()._send(r, generation, members, tensors, layout, report)
        if transport_ok:
            report.num_bytes = sum(spec.nbytes for spec in layout.tensors)  # no padding here
        return transport_ok

    def _ready_ranks(self, r: int, member: str) -> int | None:
        """The engine's worker count from its ready message; None from a bucket receiver."""
        try:
            value = json.loads(self._ready[member].get("value", ""))
        except (json.JSONDecodeError, TypeError):
            return None
        num_ranks = value.get("num_ranks") if isinstance(value, dict) else None
        return num_ranks if isinstance(num_ranks, int) and num_ranks >= 1 else None

    def _group_plan_for(
        self, generation: int, members: list[str], num_ranks: dict[str, int | None]
    ) -> _GroupPlan:
        """The endpoint of ``generation``'s group; a new generation opens a new store."""
        if self._group_plan is not None and self._group_plan.generation == generation:
            return self._group_plan
        host = self.config.advertise_host or rendezvous.default_host()
        timeout = timedelta(seconds=self.config.timeout_s)
        store = TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        offsets, next_rank = {}, 1
        for member in members:
            offsets[member] = next_rank
            next_rank += num_ranks[member]
        group = {
            "master_address": host,
            "master_port": store.port,
            "group_name": f"{GROUP_NAME_PREFIX}_{self._instance}_{generation}",
            "world_size": next_rank,
            "rank_offsets": offsets,
        }
        self._group_plan = _GroupPlan(generation, group, store)
        return self._group_plan

    def _new_group(
        self, generation: int, members: list[str], should_abort: AbortCheck
    ) -> PeerGroup:
        """Rank 0 of the SGLang engines' group, over the store its plan opened."""
        plan = self._group_plan
        assert plan is not None and plan.generation == generation
        return SGLangGroupRoot(
            plan.store,
            plan.group["group_name"],
            generation,
            plan.group["world_size"],
            self.backend,
            self.device,
            self.config.timeout_s,
            should_abort,
        )

    def _broadcast(
        self,
        group: PeerGroup,
        tensors: dict[str, torch.Tensor],
        layout: protocol.Layout,
        peer_lost: AbortCheck,
    ) -> list[int]:
        """One broadcast per tensor in manifest order, two in flight; per-tensor checksums."""
        algo = self._checksum_algo()
        checksums = []
        in_flight: list = []
        for spec in layout.tensors:
            dtype = protocol.dtype_from_name(spec.dtype)
            wire = tensors[spec.name].to(device=self.device, dtype=dtype).contiguous()
            checksums.append(tensor_checksum(wire, algo))
            self._before_send(len(checksums) - 1, wire)
            in_flight.append((group.broadcast(wire), wire))  # keep ``wire`` alive until done
            if len(in_flight) > 2:
                group.wait(in_flight.pop(0)[0], peer_lost)
        for work, _ in in_flight:
            group.wait(work, peer_lost)
        return checksums


def make_weight_sender(
    paths: RunPaths,
    config: WeightSyncConfig,
    device: str | torch.device = "cpu",
    attempt: str = "",
) -> WeightSender:
    """The trainer's sender for ``config.transport``."""
    sender_class = PerTensorSender if config.transport == TRANSPORT else WeightSender
    return sender_class(paths, config, device, attempt)


# --- the rollout's side ---------------------------------------------------------------------------
class PerTensorReceiver(WeightReceiver):
    """``WeightReceiver`` for ``transport=sglang_distributed``: ``engine`` receives the data.

    Same calls and fail-closed bookkeeping. ``load_fn`` is used only for the filesystem
    (joining and fallback); network updates go into ``engine`` directly. A failure after
    the engine started receiving fails closed (SGLang says its weights are then partial)
    and asks the trainer for a retry round.
    """

    def __init__(
        self,
        paths: RunPaths,
        engine_id: str,
        config: WeightSyncConfig,
        engine: PerTensorEngine,
        token: str | None = None,
        initial_policy_version: int | None = None,
        attempt: str = "",
    ) -> None:
        if config.transport != TRANSPORT:
            raise ValueError(f"PerTensorReceiver needs weightsync.transport={TRANSPORT!r}")
        super().__init__(
            paths, engine_id, config, "cpu", token, initial_policy_version, attempt
        )  # fmt: skip
        self.engine = engine
        self._joined_group: str | None = None

    def close(self) -> None:
        self._leave_group()
        super().close()

    def _ready_value(self) -> str:
        return json.dumps({"num_ranks": self.engine.num_ranks})

    def _check_plan(self, r: int, plan: dict) -> None:
        if plan.get("transport") != TRANSPORT:
            raise WeightVerificationError(f"plan of round {r} is not for {TRANSPORT}")

    def _take_part(
        self, r: int, plan: dict, manifest: protocol.Manifest, load_fn: LoadFn, start: float
    ) -> tuple[WeightUpdate | None, bool]:
        """The engine joins the group, receives every tensor, checks the signed digest."""
        specs = list(manifest.layout.tensors)
        try:
            self._join(plan)
        except (RuntimeError, WeightSyncError) as error:  # weights untouched
            return self._transport_failed(r, f"joining the group: {error}")
        try:
            self.engine.receive(specs)
            digest = self._read_signed(f"r/{r}/digest")
            if "abort" in digest:
                raise WeightSyncError(f"trainer aborted the round: {digest['abort']}")
        except WeightVerificationError as error:  # a forged digest
            self._reject(r, str(error))
            return None, False
        except (RuntimeError, WeightSyncError) as error:
            self._fail_closed(f"policy_version {manifest.policy_version} not received: {error}")
            return self._transport_failed(r, str(error))
        try:
            if digest.get("round") != r:
                raise WeightVerificationError(f"digest of round {digest.get('round')} for {r}")
            self.engine.verify(specs, digest["checksums"], manifest.checksum_algo)
        except WeightVerificationError as error:
            self._reject(r, str(error))
            return None, False
        return self._switched(r, manifest, start), False

    def _switched(self, r: int, manifest: protocol.Manifest, start: float) -> WeightUpdate:
        self._version = manifest.policy_version
        self._fail_closed_reason = None
        self._report(r, "ok", "")
        log.info("weightsync: engine %s switched to policy_version %d (%s)",
                 self.engine_id, self._version, TRANSPORT)  # fmt: skip
        num_bytes = sum(spec.nbytes for spec in manifest.layout.tensors)
        return WeightUpdate(self._version, num_bytes, time.monotonic() - start, "network")

    def _join(self, plan: dict) -> None:
        group = plan["group"]
        if self._joined_group == group["group_name"]:
            return
        self._leave_group()
        endpoint = GroupEndpoint(
            master_address=group["master_address"],
            master_port=group["master_port"],
            rank_offset=group["rank_offsets"][self._member],
            world_size=group["world_size"],
            group_name=group["group_name"],
            backend=plan["backend"],
        )
        self.engine.join_group(endpoint)
        self._joined_group = endpoint.group_name

    def _leave_group(self) -> None:
        if self._joined_group is not None:
            self.engine.leave_group(self._joined_group)
        self._joined_group = None

    def _forget_group(self) -> None:
        self._leave_group()
        super()._forget_group()

    def _read_signed(self, key: str, timeout_s: float | None = None) -> dict:
        """``WeightReceiver._read_signed``; a message without a signature is a forgery too."""
        try:
            return super()._read_signed(key, timeout_s)
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise WeightVerificationError(f"unsigned or malformed {key}: {error!r}") from error
