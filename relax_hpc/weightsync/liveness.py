"""Engine liveness: one TCP connection from each admitted engine to the trainer.

The kernel closes a process's sockets when it dies, SIGKILL included, so the trainer sees
an engine process die within milliseconds, in every phase of a sync, and no phase waits
out ``timeout_s`` for it. A connection counts only once it proved its member:

    trainer -> engine   "<nonce>\\n"                       (fresh, random per connection)
    engine  -> trainer  "<member id> <HMAC(token, alive|member|nonce)>\\n"

A replayed proof fails (the nonce is new), so a peer without the token cannot speak for an
admitted engine; a connection that has not proved itself within ``HANDSHAKE_S`` is closed,
and at most ``MAX_PENDING`` such connections are kept (the oldest goes first), so a flood
of connections costs file descriptors for a few seconds and changes nothing. What this
cannot see: a hung engine or a lost node (no FIN); those remain bounded by ``timeout_s``.

After the proof the same connection carries *nudges*: one byte that says "look at the
store now" (``NUDGE``), trainer -> engines when a round is called, engine -> trainer when
it wrote a message the trainer waits for. A nudge carries no information: the store stays
the only source of truth, and a side that gets none (no connection, a lost one) finds
the same keys by polling ``poll_s``, only later. A nudge lets a waiting side wake within
a loopback round trip instead of a poll interval. Must not: know about rounds or groups.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import select
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from relax_hpc.weightsync import rendezvous

log = logging.getLogger(__name__)

HANDSHAKE_S = 5.0
MAX_PENDING = 128
_MAX_LINE = 256
NUDGE = b"!"


def alive_proof(token: str, member: str, nonce: str) -> str:
    return rendezvous.sign(token, f"alive|{member}|{nonce}".encode())


@dataclass
class _Pending:
    sock: socket.socket
    nonce: str
    deadline: float
    data: bytes = b""


class LivenessMonitor:
    """The trainer's end: accepts engines' connections and tells which members died.

    Listens on ``host`` (the trainer's advertised address), a free port; raises ``OSError``
    when it cannot (the sender then runs without it, on timeouts alone).
    """

    def __init__(self, host: str, token: str) -> None:
        self._token = token
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._listener = socket.create_server((host, 0), family=family, backlog=MAX_PENDING)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._pending: dict[socket.socket, _Pending] = {}
        self._proven: dict[socket.socket, str] = {}
        self._alive: dict[str, socket.socket] = {}
        self._dead: set[str] = set()
        self._lock = threading.Lock()
        # Nudges so far, and per waiting thread the count it last saw: the trainer's loop
        # (waiting for samples) and its background weight send (waiting for engines' messages)
        # each see every nudge; one consuming a shared flag could make the other miss it.
        self._nudges = 0
        self._nudge_cond = threading.Condition()
        self._seen = threading.local()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="weightsync-liveness", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    def is_dead(self, member: str) -> bool:
        """True once ``member``'s proven connection closed (its process died or left)."""
        with self._lock:
            return member in self._dead

    def is_connected(self, member: str) -> bool:
        with self._lock:
            return member in self._alive

    def nudge_all(self) -> None:
        """Tell every proven engine to look at the store now (best effort, never blocks)."""
        with self._lock:
            sockets = list(self._alive.values())
        for sock in sockets:
            nudge(sock)  # a full buffer, or closed meanwhile: it polls, or it is gone

    def wait_for_nudge(self, timeout_s: float) -> bool:
        """Until an engine nudged since this thread's last wait, or ``timeout_s``; whether
        one did. An engine nudges after it wrote, and the caller looks again after this
        returns, so a nudge is never lost (an old one only costs one more look)."""
        seen = getattr(self._seen, "count", 0)
        with self._nudge_cond:
            fired = self._nudge_cond.wait_for(lambda: self._nudges > seen, timeout_s)
            self._seen.count = self._nudges
        return fired

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2.0)

    # --- the selector loop, on its own thread -------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                for key, _ in self._selector.select(timeout=self._next_timeout()):
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._on_readable(key.fileobj)
                self._expire_handshakes()
        finally:
            for sock in [self._listener, *self._pending, *self._proven]:
                sock.close()
            self._selector.close()

    def _next_timeout(self) -> float:
        deadlines = [p.deadline for p in self._pending.values()]
        return max(0.0, min(deadlines, default=time.monotonic() + 0.2) - time.monotonic())

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, ConnectionError):
            return
        if len(self._pending) >= MAX_PENDING:
            self._forget(min(self._pending.values(), key=lambda p: p.deadline).sock)
        nonce = secrets.token_hex(16)
        try:
            sock.setblocking(False)
            _send_at_once(sock)
            sock.send(f"{nonce}\n".encode())
        except OSError:
            sock.close()
            return
        self._pending[sock] = _Pending(sock, nonce, time.monotonic() + HANDSHAKE_S)
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _on_readable(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(_MAX_LINE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if sock in self._proven:
            if not data:  # EOF: the engine's process is gone (or it closed on purpose)
                self._forget(sock)
            else:  # nudges: whatever a proven engine sends only wakes the sender
                with self._nudge_cond:
                    self._nudges += 1
                    self._nudge_cond.notify_all()
            return
        pending = self._pending[sock]
        pending.data += data
        if not data or len(pending.data) > _MAX_LINE:
            self._forget(sock)
        elif b"\n" in pending.data:
            self._prove(pending)

    def _prove(self, pending: _Pending) -> None:
        line = pending.data.split(b"\n", 1)[0].decode("ascii", errors="replace")
        member, _, proof = line.partition(" ")
        if not rendezvous.verify_signature(
            self._token, f"alive|{member}|{pending.nonce}".encode(), proof
        ):
            log.warning("weightsync: liveness connection with a bad proof for %r closed", member)
            self._forget(pending.sock)
            return
        del self._pending[pending.sock]
        with self._lock:
            previous = self._alive.pop(member, None)
            self._alive[member] = pending.sock
            self._dead.discard(member)
        self._proven[pending.sock] = member
        if previous is not None:
            self._forget(previous)  # the engine reconnected; its older connection is spent

    def _forget(self, sock: socket.socket) -> None:
        self._pending.pop(sock, None)
        member = self._proven.pop(sock, None)
        if member is not None:
            with self._lock:
                if self._alive.get(member) is sock:
                    del self._alive[member]
                    self._dead.add(member)
                    log.info("weightsync: liveness connection of %s closed", member)
        self._selector.unregister(sock)
        sock.close()

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            self._forget(pending.sock)


def connect(host: str, port: int, token: str, member: str, timeout_s: float) -> socket.socket:
    """The engine's end: a proven connection to the trainer's monitor, kept open for life.

    Raises ``OSError`` when the trainer cannot be reached (the caller retries later).
    """
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        nonce = b""
        while not nonce.endswith(b"\n"):
            chunk = sock.recv(64)
            if not chunk or len(nonce) > _MAX_LINE:
                raise ConnectionError("the trainer's liveness monitor closed the connection")
            nonce += chunk
        proof = alive_proof(token, member, nonce.strip().decode("ascii"))
        sock.sendall(f"{member} {proof}\n".encode())
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        _send_at_once(sock)
        return sock
    except BaseException:
        sock.close()
        raise


def _send_at_once(sock: socket.socket) -> None:
    """No Nagle on a nudge connection: a nudge is one byte, and Nagle holds a small segment
    until the previous one is acknowledged, which the peer's delayed ACK can put off by tens
    of ms (measured: an engine's result nudge reached a waiting trainer 3-20 ms after it was
    sent, the trainer's ``weightsync.poll_s`` when it was held past it)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def nudge(sock: socket.socket) -> None:
    """One nudge to the other end (best effort: it polls too)."""
    with contextlib.suppress(OSError):
        sock.send(NUDGE)


def wait_for_nudge(sock: socket.socket, timeout_s: float) -> bool:
    """Until the trainer nudges or ``timeout_s``; whether it did. Reads every nudge already
    there, so the next wait sleeps until a new one. Raises ``ConnectionError`` when the
    trainer closed the connection (the caller polls without it)."""
    readable, _, _ = select.select([sock], [], [], max(timeout_s, 0.0))
    if not readable:
        return False
    try:
        data = sock.recv(4096, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        data = b""
    if not data:
        raise ConnectionError("the trainer closed the liveness connection")
    return True
