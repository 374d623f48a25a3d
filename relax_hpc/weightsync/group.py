"""The transport: the trainer's TCPStore and one standalone process group per generation.

A *generation* is one membership of the group: trainer rank 0 plus the engines of that
round, ranks 1..n in the order of the round's member list. Every generation gets a fresh
``PrefixStore("gen/<g>", store)`` namespace and a fresh backend object
(``ProcessGroupGloo(store, rank, size, timeout)`` on CPU, ``ProcessGroupNCCL(store, rank,
size, options)`` on CUDA), built directly from ``torch._C._distributed_c10d``. Nothing
here calls ``init_process_group`` or touches the default group, so the trainer's own
groups are untouched and a group can be dropped and rebuilt at any time.

Bounded in time: the store has ``timeout_s`` on every blocking call; Gloo applies
``timeout_s`` to every operation (a dead or stopped peer surfaces as a timeout or a
connection error, never a hang); for NCCL, ``wait`` polls ``Work.is_completed`` until a
deadline and aborts the communicator when it passes. A group that failed is *abandoned*:
its backend and pending work go to a daemon thread that drops the references, because
a Gloo backend's destructor waits for queued operations to time out.

Must not: know about manifests, tokens or engines (see ``sender``/``receiver``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import timedelta

import torch
from torch._C._distributed_c10d import (
    Backend,
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    TCPStore,
    Work,
)

from relax_hpc.weightsync.errors import WeightSyncTimeout

log = logging.getLogger(__name__)

STORE_PREFIX = "relax_hpc/weightsync"
_NCCL_POLL_S = 0.0005


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> ``nccl`` on CUDA, ``gloo`` otherwise; NCCL without CUDA is a user error.

    ``gloo`` with a CUDA device is allowed: the wire buffers then live in host memory
    (``wire_device``), which is how a trainer shares its GPUs with the engines it feeds:
    NCCL refuses two ranks of one group on the same GPU.
    """
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("weightsync.backend='nccl' needs a CUDA device; use 'gloo' or 'auto'")
    return backend


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where the broadcast buffers live: the CUDA device for NCCL, host memory for Gloo."""
    return device if backend == "nccl" else torch.device("cpu")


def open_store(host: str, port: int, is_server: bool, timeout_s: float) -> Store:
    """The trainer's TCPStore (server) or a connection to it, under our key prefix."""
    store = TCPStore(
        host,
        port,
        None,
        is_server,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return PrefixStore(STORE_PREFIX, store)


def store_port(store: Store) -> int:
    """The port a server store actually bound (``port=0`` picks a free one)."""
    return store.underlying_store.port


def has_key(store: Store, key: str) -> bool:
    return store.check([key])


def wait_for_key(store: Store, key: str, timeout_s: float, poll_s: float = 0.005) -> bytes:
    """Wait until ``key`` exists (polling, so no socket timeout applies), return its value."""
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise WeightSyncTimeout(f"store key {key!r} not set within {timeout_s:.1f} s")
        time.sleep(poll_s)
    return store.get(key)


class _Reaper:
    """Drops references to failed backends on a daemon thread (their destructors block)."""

    def __init__(self) -> None:
        self._graves: queue.SimpleQueue[list] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def bury(self, objects: list) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="weightsync-reaper", daemon=True
                )
                self._thread.start()
        self._graves.put(objects)

    def _run(self) -> None:
        while True:
            grave = self._graves.get()
            grave.clear()


_REAPER = _Reaper()


class PeerGroup:
    """One generation's process group; rank 0 is the trainer."""

    def __init__(
        self,
        store: Store,
        generation: int,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.backend_name = backend
        self.device = device
        self.timeout_s = timeout_s
        self._pending: list[Work] = []
        group_store = PrefixStore(f"gen/{generation}", store)
        self._backend: Backend | None = _make_backend(
            group_store, rank, world_size, backend, device, timeout_s
        )

    def broadcast(self, buffer: torch.Tensor) -> Work:
        """Start a broadcast from rank 0; complete it with ``wait``."""
        assert self._backend is not None, "broadcast on an abandoned group"
        options = BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        options.timeout = timedelta(seconds=self.timeout_s)
        work = self._backend.broadcast([buffer], options)
        self._pending.append(work)
        return work

    def wait(self, work: Work) -> None:
        """Complete ``work`` within ``timeout_s``; raises on timeout or a transport error."""
        if self.backend_name == "nccl":
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():
                if time.monotonic() >= deadline:
                    raise WeightSyncTimeout(f"NCCL broadcast not done after {self.timeout_s} s")
                time.sleep(_NCCL_POLL_S)
        work.wait()  # Gloo: blocks, bounded by the op timeout; NCCL: orders the current stream
        self._pending.remove(work)

    def abandon(self) -> None:
        """Give up on this group without blocking; it must not be used again."""
        backend, self._backend = self._backend, None
        if backend is None:
            return
        if self.backend_name == "nccl":
            try:
                backend.abort()
            except RuntimeError as error:
                log.warning("weightsync: aborting NCCL group %d: %s", self.generation, error)
        _REAPER.bury([backend, self._pending])
        self._pending = []

    def close(self) -> None:
        """Release a healthy group (no pending work)."""
        if self._pending:
            self.abandon()
            return
        backend, self._backend = self._backend, None
        if backend is not None and self.backend_name == "nccl":
            backend.shutdown()


def _make_backend(
    store: Store,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    timeout_s: float,
) -> Backend:
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return ProcessGroupGloo(store, rank, world_size, timeout)
    from torch._C._distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    nccl = ProcessGroupNCCL(store, rank, world_size, options)
    nccl.eager_connect_single_device(device)  # form the communicator now, within the timeout
    return nccl
