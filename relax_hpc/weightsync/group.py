"""The transport: the trainer's TCPStore and one standalone process group per generation.

A *generation* is one membership of the group: trainer rank 0 plus the engines of that
round, ranks 1..n in the order of the round's member list. Every generation gets a fresh
``PrefixStore("gen/<g>", store)`` namespace and a fresh backend object
(``ProcessGroupGloo(store, rank, size, timeout)`` on CPU, ``ProcessGroupNCCL(store, rank,
size, options)`` on CUDA), built directly from ``torch._C._distributed_c10d``. Nothing
here calls ``init_process_group`` or touches the default group, so the trainer's own
groups are untouched and a group can be dropped and rebuilt at any time.

Bounded in time, and quick to give up: the store has ``timeout_s`` on every blocking call.
A group forms on a daemon thread over a store connection of its own (a TCPStore client
holds a lock through a blocking wait, and Gloo retries a peer that died mid-formation for
several times ``timeout_s``); the caller waits at most ``timeout_s`` and stops at once
when its ``should_abort`` check names a reason (a peer died, the trainer aborted the
round). ``wait`` completes an operation the same way, in slices of ``WAIT_SLICE_S``
(Gloo's ``Work.wait(timeout)`` returns as soon as the operation is done; NCCL's
``is_completed`` is polled). A group that failed is *abandoned*: its backend and pending
work go to a daemon thread that drops the references, because a Gloo backend's
destructor waits for queued operations to time out.

Must not: know about manifests, tokens or engines (see ``sender``/``receiver``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
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

from relax_hpc.weightsync.errors import WeightSyncAborted, WeightSyncTimeout

log = logging.getLogger(__name__)

STORE_PREFIX = "relax_hpc/weightsync"
WAIT_SLICE_S = 0.05  # how often a waiting caller asks should_abort
_NCCL_POLL_S = 0.0005

AbortCheck = Callable[[], str | None]  # a reason to give up now, or None
StoreConnector = Callable[[], Store]  # opens a new client connection to the trainer's store


def never_abort() -> str | None:
    return None


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


def wait_for_key(store: Store, key: str, timeout_s: float, poll_s: float = 0.002) -> bytes:
    """Wait until ``key`` exists (polling, so no socket timeout applies), return its value.

    The first looks come 0.5 ms apart, doubling up to ``poll_s``: a round's plan and digest
    usually come within a few ms, and a fixed 5 ms poll added ~2.5 ms to each (measured:
    the trainer's side of a sync-mode grpo_tiny round 13-16 -> 8-11 ms), while a long wait
    still costs one store request per ``poll_s``."""
    deadline = time.monotonic() + timeout_s
    pause_s = min(0.0005, poll_s)
    while not store.check([key]):
        if time.monotonic() >= deadline:
            raise WeightSyncTimeout(f"store key {key!r} not set within {timeout_s:.1f} s")
        time.sleep(pause_s)
        pause_s = min(2 * pause_s, poll_s)
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


def form_on_thread(
    make: Callable[[], Backend], timeout_s: float, should_abort: AbortCheck, what: str
) -> Backend:
    """Run the blocking ``make`` on a daemon thread; give up after ``timeout_s`` or as soon as
    ``should_abort`` names a reason. A formation given up on runs on in the background until
    its own timeouts and is dropped there."""
    outcome: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["backend"] = make()
        except BaseException as error:  # handed to the waiting caller
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name=f"weightsync-form-{what}", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(WAIT_SLICE_S):
        reason = should_abort()
        if reason is not None:
            raise WeightSyncAborted(f"forming {what} given up: {reason}")
        if time.monotonic() >= deadline:
            raise WeightSyncTimeout(f"forming {what} not done after {timeout_s:.1f} s")
    if "error" in outcome:
        raise outcome.pop("error")
    return outcome.pop("backend")


class PeerGroup:
    """One generation's process group; rank 0 is the trainer.

    The constructor returns once the group formed; it raises ``WeightSyncAborted``,
    ``WeightSyncTimeout`` or the backend's ``RuntimeError`` when it did not.
    """

    def __init__(
        self,
        connect_store: StoreConnector,
        generation: int,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float,
        should_abort: AbortCheck = never_abort,
    ) -> None:
        self.generation = generation
        self.rank = rank
        self.world_size = world_size
        self.backend_name = backend
        self.device = device
        self.timeout_s = timeout_s
        self._pending: list[Work] = []

        def make() -> Backend:
            group_store = PrefixStore(f"gen/{generation}", connect_store())
            return _make_backend(group_store, rank, world_size, backend, device, timeout_s)

        self._backend: Backend | None = form_on_thread(
            make, timeout_s, should_abort, f"group {generation}"
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

    def wait(self, work: Work, should_abort: AbortCheck = never_abort) -> None:
        """Complete ``work`` within ``timeout_s``, giving up as soon as ``should_abort`` names
        a reason; raises on timeout, abort or a transport error."""
        deadline = time.monotonic() + self.timeout_s
        while not self._wait_slice(work):
            reason = should_abort()
            if reason is not None:
                raise WeightSyncAborted(reason)
            if time.monotonic() >= deadline:
                raise WeightSyncTimeout(
                    f"{self.backend_name} broadcast not done after {self.timeout_s} s"
                )
        self._pending.remove(work)

    def _wait_slice(self, work: Work) -> bool:
        """Wait up to ``WAIT_SLICE_S``; True once ``work`` is done (raising its error)."""
        if self.backend_name == "nccl":
            end = time.monotonic() + WAIT_SLICE_S
            while not work.is_completed():
                if time.monotonic() >= end:
                    return False
                time.sleep(_NCCL_POLL_S)
            work.wait()  # orders the current stream after the collective
            return True
        try:
            work.wait(timedelta(seconds=WAIT_SLICE_S))  # returns as soon as it is done
            return True
        except RuntimeError:
            if not work.is_completed():
                return False  # only the slice ran out
        work.wait()  # done with an error: raise that error, not the slice's timeout
        return True

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
