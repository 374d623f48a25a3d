"""The judge's HTTP server: batched scoring of ``relax_hpc.reward/1`` requests.

Request handler threads (``ThreadingHTTPServer``, standard library) check the request's
signature (``X-Relax-Signature``: HMAC-SHA256 of the body with this server's token; a
request without a valid one gets 401 and is never scored), decode it and queue its items.
One batching thread takes up to ``max_batch`` queued items (after waiting ``gather_s`` for
more to arrive, so that requests of several rollout workers share a forward pass), scores
them with the judge and hands each result back to the request that queued it.

A retried request whose first answer was lost (a client timeout, a dropped connection)
joins the scoring still in flight, or is answered from a bounded cache of recent results,
instead of being scored again: the key is a hash of the item (prompt, response, reference,
metadata), so a sample is judged once per server start.

What anyone who reaches the port can cost is bounded (``connections``): a request must
arrive whole within ``read_deadline_s``, at most ``max_reading`` connections read at once
(the oldest is cut for a new one), and a body is read only when it is at most
``MAX_BODY_BYTES`` (413) and the request carries a well-formed signature header (401
before a byte of it is read). A malformed request (request line, ``Content-Length``) gets
400; one request per connection.

``GET /v1/health`` answers ``{"protocol", "instance", "ready"}`` without a signature (it
reveals nothing); the address file is the readiness signal clients use.

Must not: build models or know the run directory (``relax_hpc.judge.main`` does both).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from relax_hpc.judge.connections import BoundedHTTPServer, ConnectionGuard
from relax_hpc.rollout.rewards.protocol import (
    HEALTH_PATH,
    PROTOCOL,
    SCORE_PATH,
    SIGNATURE_HEADER,
    SIGNATURE_PREFIX,
    ProtocolError,
    decode_request,
    encode_response,
    signature_valid,
)
from relax_hpc.rollout.rewards.result import BatchScorer, RewardResult, failed
from relax_hpc.rollout.rewards.scorer import ScoreItem

log = logging.getLogger(__name__)
# A request of the rollout's client is ``judge.client.batch_size`` texts: far below this
MAX_BODY_BYTES = 8 << 20
CACHE_ITEMS = 65536
READ_DEADLINE_S = 10.0
MAX_READING = 64
MAX_OPEN = 512  # reading + scoring; only holders of the token get to scoring
# At a stop, how long requests already being answered may take: bounded, since a flood's
# idle connections stay open until their read deadline.
STOP_DRAIN_S = 2.0


class Refusal(Exception):
    """A request answered with ``status`` and ``reason`` before its body was read."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def content_length(value: str | None, limit: int = MAX_BODY_BYTES) -> int:
    """The body size a request announces; ``Refusal`` (400/413) when it cannot be read."""
    if value is None:
        raise Refusal(400, "Content-Length is required (chunked bodies are not accepted)")
    if not value.strip().isdigit():
        raise Refusal(400, f"Content-Length is not a non-negative integer: {value[:40]!r}")
    length = int(value)
    if length == 0:
        raise Refusal(400, "the body is empty")
    if length > limit:
        raise Refusal(
            413, f"the body of {length} bytes is over {limit} bytes: lower judge.client.batch_size"
        )
    return length


def well_formed_signature(header: str | None) -> bool:
    """Whether ``header`` could be a signature (checked before the body is read)."""
    digest = (header or "").removeprefix(SIGNATURE_PREFIX)
    return (
        bool(header and header.startswith(SIGNATURE_PREFIX))
        and len(digest) == 64
        and all(c in "0123456789abcdef" for c in digest)
    )


@dataclass
class ServerCounts:
    requests: int = 0
    refused: int = 0  # bad signature or malformed request
    samples: int = 0  # items answered
    scored: int = 0  # items the judge scored (the rest came from the cache)
    batches: int = 0
    judge_s: float = 0.0  # time spent inside the judge
    started_s: float = field(default_factory=time.time)


def item_key(item: ScoreItem) -> str:
    text = json.dumps(
        [item.prompt, item.completion, item.answer, dict(item.metadata)],
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


class JudgeServer:
    def __init__(
        self,
        scorer: BatchScorer,
        token: str,
        host: str = "0.0.0.0",
        port: int = 0,
        max_batch: int = 256,
        gather_s: float = 0.005,
        instance: str = "",
        read_deadline_s: float = READ_DEADLINE_S,
        max_reading: int = MAX_READING,
        max_open: int = MAX_OPEN,
    ) -> None:
        self.scorer = scorer
        self.token = token
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.instance = instance
        self.counts = ServerCounts()
        self._queue: queue.Queue[tuple[str, ScoreItem, Future] | None] = queue.Queue()
        self._cache: OrderedDict[str, RewardResult] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.guard = ConnectionGuard(max_reading, max_open, read_deadline_s)
        self._http = BoundedHTTPServer((host, port), _handler_class(self), self.guard)
        self._threads = [
            threading.Thread(target=self._http.serve_forever, name="judge-http", daemon=True),
            threading.Thread(target=self._batch_forever, name="judge-batches", daemon=True),
        ]

    @property
    def port(self) -> int:
        return self._http.server_address[1]

    def start(self) -> JudgeServer:
        self.guard.start()
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()
        self._drain(STOP_DRAIN_S)
        self.guard.stop()
        self._queue.put(None)
        self._threads[1].join(timeout=30)

    def _drain(self, timeout_s: float) -> None:
        """Until no admitted connection is open, at most ``timeout_s``. Handler threads are
        daemons that ``server_close`` does not join: without this a request being answered
        at the stop could be counted after the judge's final status was written (seen: a
        refusal the flooding client got was missing there)."""
        deadline = time.monotonic() + timeout_s
        while self.guard.counts()[0] and time.monotonic() < deadline:
            time.sleep(0.01)

    def score(self, items: list[ScoreItem]) -> list[RewardResult]:
        """Queue ``items`` for the batching thread and wait for their results."""
        futures = [self._future(item_key(item), item) for item in items]
        results = [future.result() for future in futures]
        with self._lock:
            self.counts.samples += len(results)
        return results

    def _future(self, key: str, item: ScoreItem) -> Future:
        """The result of ``item``: cached, already being scored, or queued now."""
        with self._lock:
            if key in self._pending:
                return self._pending[key]
            future: Future = Future()
            if key in self._cache:
                future.set_result(self._cache[key])
                return future
            self._pending[key] = future
        self._queue.put((key, item, future))
        return future

    def _batch_forever(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.gather_s
            while len(batch) < self.max_batch:
                try:
                    entry = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if entry is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(entry)
            self._score_batch(batch)
        while not self._queue.empty():  # stopping: answer what is left
            entry = self._queue.get()
            if entry is not None:
                with self._lock:
                    self._pending.pop(entry[0], None)
                entry[2].set_result(failed("the judge server is stopping"))

    def _score_batch(self, batch: list[tuple[str, ScoreItem, Future]]) -> None:
        started = time.monotonic()
        try:
            results = self.scorer.score([item for _, item, _ in batch])
        except Exception as err:  # scorers should not raise; a bug fails the batch, not us
            log.exception("judge: scoring a batch raised")
            results = [failed(f"the judge raised {type(err).__name__}: {err}") for _ in batch]
        with self._lock:
            self.counts.batches += 1
            self.counts.scored += len(batch)
            self.counts.judge_s += time.monotonic() - started
            for (key, _, _), result in zip(batch, results, strict=True):
                self._pending.pop(key, None)
                if result.failed is None:  # a failure may pass: the next request tries again
                    self._cache[key] = result
                    self._cache.move_to_end(key)
            while len(self._cache) > CACHE_ITEMS:
                self._cache.popitem(last=False)
        for (_, _, future), result in zip(batch, results, strict=True):
            future.set_result(result)

    def handle_score(
        self, body: bytes, signature: str | None, connection: Any = None
    ) -> tuple[int, bytes] | None:
        """The answer to a request whose body is read; None when ``connection`` was cut
        meanwhile (nobody is there to answer)."""
        with self._lock:
            self.counts.requests += 1
        if not signature_valid(self.token, body, signature):
            return self.refuse(401, "missing or wrong X-Relax-Signature (not this run's judge?)")
        if connection is not None and not self.guard.verified(connection):
            return None
        try:
            ids, items = decode_request(body)
        except ProtocolError as err:
            return self.refuse(400, str(err))
        return 200, encode_response(ids, self.score(items))

    def refuse(self, status: int, reason: str) -> tuple[int, bytes]:
        with self._lock:
            self.counts.refused += 1
        log.warning("judge: refused a request (%d): %s", status, reason)
        return status, json.dumps({"protocol": PROTOCOL, "error": reason}).encode()

    def health(self) -> dict[str, Any]:
        return {"protocol": PROTOCOL, "instance": self.instance, "ready": True}


def _handler_class(server: JudgeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        default_request_version = "HTTP/1.1"  # a bad request line gets a status line (400)
        # Per read, a backstop only: the guard's reaper cuts the whole request at its deadline
        # (and counts it); a timeout equal to the deadline would race the reaper on a loaded
        # machine and end connections uncounted.
        timeout = 2 * server.guard.read_deadline_s

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.split("?")[0] != SCORE_PATH:
                return self._answer(404, b'{"error": "unknown path"}')
            signature = self.headers.get(SIGNATURE_HEADER)
            try:
                length = content_length(self.headers.get("Content-Length"))
                if not well_formed_signature(signature):
                    raise Refusal(401, f"no well-formed {SIGNATURE_HEADER} header")
            except Refusal as refusal:  # answered unread: the peer may still be sending
                return self._answer(*server.refuse(refusal.status, str(refusal)))
            body = self.rfile.read(length)
            if len(body) < length:
                return None  # cut at its deadline, or the peer hung up
            answer = server.handle_score(body, signature, self.connection)
            if answer is not None:
                self._answer(*answer)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.split("?")[0] != HEALTH_PATH:
                return self._answer(404, b'{"error": "unknown path"}')
            self._answer(200, json.dumps(server.health()).encode())

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return None  # per-request lines would flood the log; counts go to status/

    return Handler
