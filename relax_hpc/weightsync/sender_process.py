"""The trainer's ``WeightSender`` in a child process of its own (``weightsync.send_process``).

Why: on a CPU trainer the sending thread of ``weightsync.background_send`` competes with the
training loop for Python's GIL: every store request, signature and bucket of a round waits
for the loop to let go of it, and the loop waits for the round in turn. Measured on 2
cores (grpo_tiny, async): a trainer that sends nothing steps 1.16x its training time, one
that sends from a thread 1.25x. In a process of its own the round runs beside the loop.

What stays the same: the whole round protocol, admission, liveness and the filesystem
fallback are ``WeightSender``'s (``sender``), run unchanged in the child; the trainer holds a
``SenderProcess``, which answers the calls the trainer makes of a sender (``start``,
``sync``, ``admit_joiners``, ``wait_for_engines``, ``close``). The child owns the rendezvous
store and the liveness port; ``trainer.json`` still names the trainer's pid.

How they talk: one socket pair carries commands and their replies (pickled, one at a
time); the weights travel through ``SharedWeights`` (a memfd both map: one copy by the
trainer, none by the child); nudges from engines (a message, a published shard) are
forwarded as bytes on a pipe, which the trainer's spool wait selects on.

Failure: a child that dies makes the trainer's next call raise ``WeightSyncError`` naming
its exit; a trainer that dies takes the child with it (``PR_SET_PDEATHSIG``, and the
command socket's end of file). The child ignores the stop signals (SIGTERM, SIGUSR1,
SIGINT) that Slurm or a terminal sends to every process of the step: the trainer
checkpoints and then closes it, so a version in flight is never cut off.

Runs only where the weights are host tensors sent over Gloo (``transport=buckets``). Must
not: import the trainer or the rollout side.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from multiprocessing.connection import Connection

import torch

from relax_hpc.config.weightsync import WeightSyncConfig
from relax_hpc.paths import RunPaths
from relax_hpc.runtime import helper_cpus, own_cpus
from relax_hpc.weightsync.errors import WeightSyncError
from relax_hpc.weightsync.sender import SyncReport, WeightSender
from relax_hpc.weightsync.shared_weights import SharedWeights

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1
_IGNORED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class SenderProcess:
    """The trainer's handle on a ``WeightSender`` running in a child process."""

    def __init__(
        self,
        paths: RunPaths,
        config: WeightSyncConfig,
        device: str | torch.device = "cpu",
        attempt: str = "",
    ) -> None:
        if torch.device(device).type != "cpu" and config.backend != "gloo":
            raise ValueError("weightsync.send_process sends host tensors over Gloo only")
        self.paths = paths
        self.config = config.validate()
        self.attempt = attempt
        self._process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._nudges_fd = -1
        self._weights: SharedWeights | None = None
        self._lock = threading.Lock()  # one command and its reply at a time
        self._started = False
        self._in_flight = False  # a sync was begun and its reply not yet received
        self._sent_placement = None  # the child holds it

    # --- the calls the trainer makes of a sender ----------------------------------------------
    def start(self) -> None:
        """Start the child; it opens the store and publishes ``trainer.json`` meanwhile (the
        first ``sync`` waits for that, and raises what the start raised)."""
        ours, theirs = socket.socketpair()
        nudges_read, nudges_write = os.pipe()
        self._weights = SharedWeights()
        command = [
            sys.executable,
            "-m",
            "relax_hpc.weightsync.sender_process",
            "--commands-fd",
            str(theirs.fileno()),
            "--nudges-fd",
            str(nudges_write),
            "--weights-fd",
            str(self._weights.fd),
            "--parent-pid",
            str(os.getpid()),
        ]
        fds = (theirs.fileno(), nudges_write, self._weights.fd)
        self._process = subprocess.Popen(command, pass_fds=fds, stdin=subprocess.DEVNULL)
        theirs.close()
        os.close(nudges_write)
        self._conn = Connection(ours.detach())
        self._nudges_fd = nudges_read
        self._conn.send((self.paths, self.config, self.attempt, os.getpid()))
        log.info("weightsync: sending from a process of its own (pid %d)", self._process.pid)

    def sync(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        policy_version: int,
        only: list[str] | None = None,
    ) -> SyncReport:
        self.begin_sync(named_tensors, policy_version, only)
        return self.end_sync()

    def begin_sync(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        policy_version: int,
        only: list[str] | None = None,
    ) -> None:
        """Copy the weights into the shared file (the caller may change its own tensors
        right after) and let the child send them; ``end_sync`` collects its report."""
        with self._lock:
            self._await_start()
            if self._in_flight:
                raise RuntimeError("begin_sync: the previous sync was not ended")
            placement = self._weights.write(dict(named_tensors))
            # The child keeps the placement it was sent last (a policy's never changes).
            fresh = placement if placement is not self._sent_placement else None
            self._send("sync", fresh, policy_version, only)
            self._sent_placement = placement
            self._in_flight = True

    @property
    def in_flight(self) -> bool:
        """A sync was begun and its report not yet collected (``end_sync``)."""
        return self._in_flight

    def end_sync(self) -> SyncReport:
        """Until the sync begun last ended; its report (raises its error)."""
        with self._lock:
            self._in_flight = False
            return self._receive("sync")

    def admit_joiners(self) -> list[str]:
        with self._lock:
            self._await_start()
            self._send("admit_joiners")
            return self._receive("admit_joiners")

    def wait_for_engines(self, timeout_s: float) -> bool:
        """Until an engine nudged (forwarded by the child) or ``timeout_s``; whether one did."""
        readable, _, _ = select.select([self._nudges_fd], [], [], max(timeout_s, 0.0))
        if not readable:
            return False
        with contextlib.suppress(BlockingIOError):
            os.read(self._nudges_fd, 4096)  # every nudge so far: the caller looks again now
        return True

    def close(self) -> None:
        """Close the sender in the child and wait for it to end (killed after a bound)."""
        if self._process is None:
            return
        try:
            with self._lock, contextlib.suppress(WeightSyncError):
                self._await_start()
                if self._in_flight:
                    self._receive("sync")
                self._send("close")
                self._receive("close")
        finally:
            self._reap()

    # --- the command channel ------------------------------------------------------------------
    def _await_start(self) -> None:
        if not self._started:
            self._receive("starting")
            self._started = True

    def _send(self, name: str, *args) -> None:
        try:
            self._conn.send((name, *args))
        except OSError:
            raise self._died(name) from None

    def _receive(self, what: str):
        try:
            outcome, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._died(what) from None
        if outcome == "error":
            raise value
        return value

    def _died(self, what: str) -> WeightSyncError:
        try:
            code = self._process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None  # alive, but its end of the channel is gone
        return WeightSyncError(
            f"the weight-send process (pid {self._process.pid}) ended with exit code {code} "
            f"while {what}; its traceback is in the trainer's log above"
        )

    def _reap(self) -> None:
        try:
            self._process.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("weightsync: the send process did not end; killing it")
            self._process.kill()
            self._process.wait()
        self._conn.close()
        os.close(self._nudges_fd)
        self._weights.close()
        self._process = None


# --- the child ------------------------------------------------------------------------------------
def serve(conn: Connection, nudges_fd: int, weights: SharedWeights) -> None:
    """Run a ``WeightSender`` for the commands on ``conn`` until ``close`` or end of file."""
    paths, config, attempt, trainer_pid = conn.recv()
    sender = WeightSender(paths, config, "cpu", attempt, trainer_pid)
    try:
        if not _answer(conn, sender.start):
            return
        _forward_nudges(sender, nudges_fd)
        while True:
            try:
                name, *args = conn.recv()
            except EOFError:  # the trainer is gone
                return
            if name == "close":
                conn.send(("ok", None))
                return
            _answer(conn, lambda n=name, a=args: _run(sender, weights, n, a))
    finally:
        sender.close()


def _run(sender: WeightSender, weights: SharedWeights, name: str, args: list):
    if name == "sync":
        placement, policy_version, only = args  # None: the placement of the last sync
        views = weights.read(placement) if placement is not None else weights.read_last()
        return sender.sync(views, policy_version, only)
    if name == "admit_joiners":
        return sender.admit_joiners()
    raise ValueError(f"weightsync send process: unknown command {name!r}")


def _answer(conn: Connection, call) -> bool:
    """Send ``call``'s result, or its error for the trainer to raise; whether it returned."""
    try:
        result = call()
    except Exception as error:  # the trainer raises it at the call that caused it
        log.exception("weightsync: the send process failed")
        conn.send(("error", _picklable(error)))
        return False
    conn.send(("ok", result))
    return True


def _picklable(error: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return WeightSyncError(f"{type(error).__name__}: {error}")


def _forward_nudges(sender: WeightSender, nudges_fd: int) -> None:
    """Every engine nudge, one byte on the trainer's pipe (a full pipe already wakes it)."""
    os.set_blocking(nudges_fd, False)

    def forward() -> None:
        while True:
            if sender.wait_for_engines(1.0):
                with contextlib.suppress(BlockingIOError):
                    os.write(nudges_fd, b"!")

    threading.Thread(target=forward, name="weightsync-nudges", daemon=True).start()


def _die_with_parent(parent_pid: int) -> None:
    """Ended with the trainer however it ends (Linux; elsewhere by the socket's EOF)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the trainer died before the line above
        os._exit(1)


def _bind_to_helper_cpus() -> None:
    """Off the trainer's own CPUs when the launcher bound it (``runtime.HELPER_CPUS_VAR``):
    this process runs a round right when the trainer reads its next batch, and on the
    trainer's core it stretched each step (docs/performance.md section 12)."""
    try:
        cpus = helper_cpus()
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as err:
        log.warning("weightsync: the send process stays on the trainer's CPUs: %s", err)
    log.info("weightsync: the send process runs on CPUs %s", own_cpus())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the trainer's weight-send process")
    for flag in ("--commands-fd", "--nudges-fd", "--weights-fd", "--parent-pid"):
        parser.add_argument(flag, type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    for signum in _IGNORED_SIGNALS:  # the trainer stops first, then closes this process
        signal.signal(signum, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s trainer[0].send %(levelname)s %(name)s: %(message)s",
        stream=sys.stdout,
    )
    _bind_to_helper_cpus()
    torch.set_num_threads(1)  # bucket packing is memcpy; the trainer owns the cores
    conn = Connection(args.commands_fd)
    serve(conn, args.nudges_fd, SharedWeights(args.weights_fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
