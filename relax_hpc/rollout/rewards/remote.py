"""The client of reward servers: a user's HTTP endpoint, or the judge in its own component.

``RemoteScorer.score(items)`` cuts the batch into requests of ``batch_size`` items and
sends at most ``max_concurrency`` at a time (``protocol``: ``relax_hpc.reward/1``). Each
request has its own timeout. A request that gets a bad answer (429/5xx, a body that does not
follow the protocol, a timeout, a dropped connection) is retried, up to ``max_attempts``
answers in all; a server that cannot be reached at all (connection refused, no judge
address yet: it is restarting) is tried again without using up attempts, so a sample waits
for it, bounded by ``max_wait_s``. Tries are spaced by exponential backoff with jitter,
behind a circuit breaker shared by all requests (``resilience``). Nothing waits forever and
nothing is dropped: when the attempts or the wait are spent, each of the request's samples
is scored as *failed* with the reason (``judge: gave up after 3.1 s: 4 tries (4 answered),
last: HTTP 503 ...``), and the rollout goes on. 401/403 and other 4xx answers are not
retried (retrying cannot fix them).

Where requests go is a ``Targets``: ``EndpointTargets`` (one URL, a bearer token) or
``JudgeTargets`` (the judge's address files, read again after every failure, so that a
restarted judge is found; requests are signed with its token, which never travels).
Logs and failure reasons name a target as ``scheme://host:port/path`` only: never a query
string, a header or a token.

Must not: import torch; it sends text and receives scores.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from relax_hpc.config.rewards import ClientConfig
from relax_hpc.observe.redaction import redact
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.rewards.judge_address import read_judge_addresses
from relax_hpc.rollout.rewards.protocol import (
    SIGNATURE_HEADER,
    ProtocolError,
    decode_response,
    encode_request,
    sign_body,
)
from relax_hpc.rollout.rewards.resilience import CircuitBreaker, backoff_delay
from relax_hpc.rollout.rewards.result import RewardResult, failed
from relax_hpc.rollout.rewards.scorer import as_score_item

log = logging.getLogger(__name__)
NOT_RETRIED = (400, 401, 403, 404, 405, 413, 422)
BODY_EXCERPT_CHARS = 120


class RetryableError(Exception):
    """The call failed in a way that a later attempt may not (the message says how).

    ``reached``: the server got the request (a bad answer, a timeout), as opposed to no
    server being there at all (refused, no address)."""

    def __init__(self, reason: str, reached: bool = True) -> None:
        super().__init__(reason)
        self.reached = reached


class FatalError(Exception):
    """The server refused the request; retrying the same request cannot help."""


@dataclass(frozen=True)
class Target:
    url: str
    headers: Callable[[bytes], dict[str, str]]  # the credential headers for a body
    secrets: tuple[str, ...] = ()  # masked in anything the server's answer puts in a reason

    @property
    def label(self) -> str:
        """What logs and failure reasons may show: no query string, no credentials."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.hostname}:{parts.port or ''}{parts.path}"


class Targets(Protocol):
    def pick(self, request_index: int) -> Target: ...  # RetryableError: none up yet

    def refresh(self) -> None: ...


@dataclass
class EndpointTargets:
    """A user's endpoint: one URL, and ``Authorization: Bearer <token>`` when it has one."""

    url: str
    token: str | None = None

    def pick(self, request_index: int) -> Target:
        token = self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return Target(self.url, lambda body: headers, (token,) if token else ())

    def refresh(self) -> None:
        return None


@dataclass
class JudgeTargets:
    """The judge's servers, as their address files say; requests are spread over them."""

    paths: RunPaths
    _addresses: list = field(default_factory=list)

    def pick(self, request_index: int) -> Target:
        if not self._addresses:
            self.refresh()
        if not self._addresses:
            raise RetryableError(
                f"no judge server is up (no address in {self.paths.judge_rendezvous_dir})",
                reached=False,
            )
        address = self._addresses[request_index % len(self._addresses)]
        token = address.token
        return Target(address.url, lambda body: {SIGNATURE_HEADER: sign_body(token, body)})

    def refresh(self) -> None:
        self._addresses = read_judge_addresses(self.paths)


def post(target: Target, body: bytes, timeout_s: float) -> bytes:
    """One POST; the body of a 200 answer, else ``RetryableError`` or ``FatalError``."""
    parts = urlsplit(target.url)
    if parts.scheme == "https":
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=timeout_s, context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    headers = {"Content-Type": "application/json", **target.headers(body)}
    try:
        connection.request("POST", path or "/", body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
    except TimeoutError:
        raise RetryableError(f"no answer within {timeout_s:.3g} s") from None
    except ConnectionRefusedError as err:
        raise RetryableError(f"nothing listens there ({err})", reached=False) from None
    except (OSError, http.client.HTTPException) as err:
        raise RetryableError(f"connection failed ({type(err).__name__}: {err})") from None
    finally:
        connection.close()
    if response.status == 200:
        return data
    # masked before it is cut, so that no prefix of a secret survives
    excerpt = redact(data.decode("utf-8", "replace"), target.secrets)[:BODY_EXCERPT_CHARS].strip()
    reason = f"HTTP {response.status} {response.reason}" + (f": {excerpt}" if excerpt else "")
    if response.status in NOT_RETRIED:
        raise FatalError(reason)
    raise RetryableError(reason)


class RemoteScorer:
    def __init__(
        self,
        name: str,
        targets: Targets,
        settings: ClientConfig,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        seed: int | None = None,
    ) -> None:
        self.name = name
        self.targets = targets
        self.settings = settings
        self.clock = clock
        self.sleep = sleep
        self.breaker = CircuitBreaker(settings.breaker_failures, settings.breaker_reset_s, clock)
        self._rng = random.Random(seed)
        self.last_error = ""  # of any request: says why an open circuit is open
        self._pool = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(("requests", "retries", "wait_s", "circuit_opened"), 0.0)

    def score(self, items: Sequence[Any]) -> list[RewardResult]:
        items = [as_score_item(item) for item in items]
        deadline = self.clock() + self.settings.max_wait_s
        size = self.settings.batch_size
        chunks = [items[start : start + size] for start in range(0, len(items), size)]
        futures = [
            self._pool.submit(self._score_request, index, chunk, deadline)
            for index, chunk in enumerate(chunks)
        ]
        return list(itertools.chain.from_iterable(f.result() for f in futures))

    def metrics(self) -> dict[str, float]:
        """Running totals: ``requests``, ``retries``, ``wait_s`` (backoff and open-circuit
        waits) and ``circuit_opened`` (times); samples and failures are counted by the
        composite scorer for every part alike."""
        with self._lock:
            totals = dict(self._totals)
        totals["circuit_opened"] = float(self.breaker.times_opened)
        return {f"{key}_total": value for key, value in totals.items()}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _score_request(self, index: int, items: list, deadline: float) -> list[RewardResult]:
        """The results of one request's items, from the server or failed with the reason.

        An answer that is no good (5xx, garbage, a timeout, a dropped connection) uses up one
        of ``max_attempts``; a server that cannot be reached at all (refused, no address yet:
        the judge is restarting) does not, and is tried again until ``deadline``.
        """
        ids = [str(i) for i in range(len(items))]
        body = encode_request(ids, items)
        started, last_error, answered, tries = self.clock(), "", 0, 0
        while answered < self.settings.max_attempts:
            if not self._wait_for_breaker(deadline):
                why = f"the circuit is open after failures in a row, last: {self.last_error}"
                return self._give_up(items, why, started)
            tries += 1
            try:
                target = self.targets.pick(index)
                self._count(requests=1)
                results = decode_response(post(target, body, self._timeout(deadline)), ids)
            except FatalError as err:
                self.breaker.succeeded()  # the server answered: it is up
                return [failed(f"{self.name} refused the request: {err}") for _ in items]
            except (RetryableError, ProtocolError) as err:
                last_error = self.last_error = str(err)
                answered += getattr(err, "reached", True)
                self.breaker.failed()
                self.targets.refresh()  # a restarted judge has a new address
            else:
                self.breaker.succeeded()
                return results
            if answered >= self.settings.max_attempts or not self._pause(tries - 1, deadline):
                break
            log.info("%s: try %d failed (%s); retrying", self.name, tries, last_error)
        why = f"{tries} tries ({answered} answered), last: {last_error}"
        return self._give_up(items, why, started)

    def _timeout(self, deadline: float) -> float:
        return max(0.05, min(self.settings.timeout_s, deadline - self.clock()))

    def _wait_for_breaker(self, deadline: float) -> bool:
        """Wait while the circuit is open; False when that would pass ``deadline``."""
        while (wait := self.breaker.wait_s()) > 0:
            if self.clock() + wait > deadline:
                return False
            self._sleep(wait)
        return True

    def _pause(self, retry: int, deadline: float) -> bool:
        """Back off before the next try; False when that would pass ``deadline``."""
        delay = backoff_delay(
            retry, self.settings.backoff_s, self.settings.backoff_max_s, self._rng
        )
        if self.clock() + delay > deadline:
            return False
        self._count(retries=1)
        self._sleep(delay)
        return True

    def _sleep(self, seconds: float) -> None:
        self._count(wait_s=seconds)
        self.sleep(seconds)

    def _give_up(self, items: list, why: str, started: float) -> list[RewardResult]:
        waited = self.clock() - started
        reason = f"{self.name}: gave up after {waited:.1f} s: {why}"
        log.warning("%s (%d samples scored as failed)", reason, len(items))
        return [failed(reason) for _ in items]

    def _count(self, **increments: float) -> None:
        with self._lock:
            for key, value in increments.items():
                self._totals[key] += value
