"""Bounds on the judge server's connections: what anyone who reaches its port can cost.

Every connection gets ``read_deadline_s`` to deliver its whole request (request line,
headers, body); a reaper thread shuts down those past it, so a connection that sends half a
request line and waits costs one thread for at most that long. At most ``max_reading``
connections may be reading at once: a new one pushes out the oldest (as the weight-sync
liveness monitor does with unproven connections), so a flood cannot lock out a client that
sends its request at once, and threads stay bounded. A connection whose request carried a
valid signature leaves the count (``verified``): it is scoring, which may take long, and
only a holder of the token gets there. At most ``max_open`` connections exist in all;
beyond that a new one is closed on arrival.

Must not: parse HTTP or know signatures (``server`` does both).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)
REAP_INTERVAL_S = 0.1


class ConnectionGuard:
    def __init__(self, max_reading: int, max_open: int, read_deadline_s: float) -> None:
        self.max_reading = max_reading
        self.max_open = max_open
        self.read_deadline_s = read_deadline_s
        self.cut = 0  # connections shut down: past their deadline, pushed out or over the cap
        self._reading: dict[socket.socket, float] = {}  # deadline; insertion order = age
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_forever, name="judge-reaper", daemon=True)

    def start(self) -> None:
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()

    def admit(self, sock: socket.socket) -> bool:
        """Whether ``sock`` may be served; the oldest reading connection makes room."""
        with self._lock:
            if len(self._reading) >= self.max_reading:
                self._cut(next(iter(self._reading)))
            if len(self._open) >= self.max_open:
                self.cut += 1
                return False
            self._open.add(sock)
            self._reading[sock] = time.monotonic() + self.read_deadline_s
            return True

    def verified(self, sock: socket.socket) -> bool:
        """The request of ``sock`` is read and signed: no deadline from now on. False when it
        was cut meanwhile (its answer cannot be delivered)."""
        with self._lock:
            return self._reading.pop(sock, None) is not None

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._reading.pop(sock, None)
            self._open.discard(sock)

    def counts(self) -> tuple[int, int]:
        """(open, reading) connections now."""
        with self._lock:
            return len(self._open), len(self._reading)

    def _reap_forever(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                for sock in [s for s, deadline in self._reading.items() if deadline <= now]:
                    self._cut(sock)

    def _cut(self, sock: socket.socket) -> None:
        """Wake the thread reading ``sock`` with an end of file; it closes the socket (never
        closed here: its descriptor could be reused under the reading thread)."""
        del self._reading[sock]
        self.cut += 1
        with contextlib.suppress(OSError):  # already gone
            sock.shutdown(socket.SHUT_RDWR)


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` whose connections pass ``guard``; handler errors are one
    log line, never a traceback (a peer that hangs up mid-answer is not our bug)."""

    daemon_threads = True
    request_queue_size = 128  # a flood must not fill the accept queue ahead of the admission

    def __init__(self, address: tuple[str, int], handler: Any, guard: ConnectionGuard) -> None:
        self.guard = guard
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.guard.admit(request):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.guard.forget(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        log.info("judge: a connection ended with %s: %s", type(err).__name__, err)
