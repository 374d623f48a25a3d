"""The reward-server client against a real HTTP server on loopback that misbehaves on cue.

Every failure mode ends in bounded time: retried with backoff, then scored as failed with
the reason; refusals are not retried; the circuit breaker stops hammering a dead server;
a token never reaches a log line or a failure reason.
"""

from __future__ import annotations

import io
import logging
import random
import time

import pytest
from reward_fixtures import ScriptedRewardServer, free_port

from relax_hpc.config.rewards import ClientConfig, EndpointConfig
from relax_hpc.rollout.rewards.credentials import endpoint_token
from relax_hpc.rollout.rewards.remote import EndpointTargets, RemoteScorer
from relax_hpc.rollout.rewards.resilience import CircuitBreaker, backoff_delay
from relax_hpc.rollout.rewards.scorer import ScoreItem

FAST = ClientConfig(
    timeout_s=2.0,
    batch_size=4,
    max_concurrency=2,
    max_attempts=3,
    backoff_s=0.01,
    backoff_max_s=0.05,
    breaker_failures=100,
    breaker_reset_s=0.2,
    max_wait_s=20.0,
)
ITEMS = [ScoreItem("x" * n, "ref", {"source": "unit"}, f"prompt {n}") for n in range(1, 11)]


@pytest.fixture
def server():
    sink = ScriptedRewardServer().start()
    yield sink
    sink.stop()


def scorer_for(url: str, settings: ClientConfig = FAST, token: str | None = None) -> RemoteScorer:
    return RemoteScorer("safety", EndpointTargets(url, token), settings, seed=0)


def test_a_batch_is_split_sent_concurrently_and_answered_in_order(server):
    scorer = scorer_for(server.url, token="t0k3n-abcdef")
    results = scorer.score(ITEMS)
    assert [r.score for r in results] == [float(n) for n in range(1, 11)]
    assert all(r.failed is None and r.details == {"by": "sink"} for r in results)
    assert sorted(len(r["ids"]) for r in server.requests) == [2, 4, 4]
    assert {r["authorization"] for r in server.requests} == {"Bearer t0k3n-abcdef"}
    assert scorer.metrics()["requests_total"] == 3 and scorer.metrics()["retries_total"] == 0


@pytest.mark.parametrize("fault", ["error", "garbage", "wrong_shape", "drop", "slow"])
def test_a_transient_fault_is_retried_and_nothing_is_lost(server, fault):
    server.slow_s = 1.0
    server.then(fault)
    settings = ClientConfig(**{**vars(FAST), "batch_size": 16, "timeout_s": 0.4})
    scorer = scorer_for(server.url, settings)
    results = scorer.score(ITEMS)
    assert [r.score for r in results] == [float(n) for n in range(1, 11)]
    assert scorer.metrics()["retries_total"] == 1
    assert len(server.requests) == 2


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("error", 'HTTP 500 Internal Server Error: {"error": "model server crashed"}'),
        ("garbage", "the response is not JSON"),
        ("wrong_shape", "the response has no list 'results'"),
        ("drop", "connection failed (RemoteDisconnected"),
        ("slow", "no answer within 0.3 s"),
    ],
)
def test_a_persistent_fault_ends_in_failed_samples_with_the_reason(server, fault, reason):
    server.slow_s = 1.0
    server.then(*[fault] * 10)
    settings = ClientConfig(**{**vars(FAST), "batch_size": 16, "timeout_s": 0.3})
    started = time.monotonic()
    results = scorer_for(server.url, settings).score(ITEMS)
    assert time.monotonic() - started < 6  # 3 attempts: bounded, not hanging
    assert len(results) == len(ITEMS) and all(r.score == 0.0 for r in results)
    assert results[0].failed.startswith("safety: gave up after ")
    assert "3 tries (3 answered), last: " in results[0].failed and reason in results[0].failed
    assert len(server.requests) == 3


def test_a_refusal_is_not_retried(server):
    server.token = "right-token"
    results = scorer_for(server.url, token="wrong-token").score(ITEMS[:3])
    assert len(server.requests) == 1
    assert results[0].failed == (
        'safety refused the request: HTTP 401 Unauthorized: {"error": "bad token"}'
    )


def test_a_dead_endpoint_opens_the_circuit_and_samples_wait_only_max_wait_s():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    settings = ClientConfig(
        **{**vars(FAST), "breaker_failures": 2, "breaker_reset_s": 5.0, "max_wait_s": 1.0}
    )
    scorer = scorer_for(url, settings)
    started = time.monotonic()
    results = scorer.score(ITEMS)
    assert time.monotonic() - started < 3.0
    assert all(r.failed for r in results)
    # refused calls use up no attempts: the samples waited (max_wait_s) for a restart
    assert "(0 answered)" in results[0].failed or "circuit is open" in results[0].failed
    assert "nothing listens there" in results[0].failed
    assert scorer.metrics()["circuit_opened_total"] >= 1
    # while open, the next batch does not call at all: it fails at once, saying why
    requests = scorer.metrics()["requests_total"]
    again = scorer.score(ITEMS[:2])
    assert scorer.metrics()["requests_total"] == requests
    assert "the circuit is open after failures in a row, last: nothing listens" in again[0].failed


def test_the_token_never_reaches_a_log_or_a_reason(server, tmp_path):
    token = "sk-live-" + "7f3a" * 8
    server.then(*["echo_auth"] * 5)
    captured = io.StringIO()
    handler = logging.StreamHandler(captured)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        config = EndpointConfig(url=server.url, token_env="LAB_RM_TOKEN")
        found = endpoint_token("safety", config, None, {"LAB_RM_TOKEN": token})
        results = scorer_for(server.url, token=found).score(ITEMS[:4])
        logging.getLogger("relax_hpc.test").warning("a careless line: %s", found)
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert server.requests[0]["authorization"] == f"Bearer {token}"  # it was sent
    text = captured.getvalue()
    assert "gave up" in text and "a careless line: ***" in text
    assert token not in text and token[:12] not in text
    assert all(token not in r.failed and "Authorization: Bearer ***" in r.failed for r in results)


def test_backoff_doubles_up_to_the_cap_with_jitter():
    rng = random.Random(0)
    delays = [backoff_delay(k, 0.5, 4.0, rng) for k in range(6)]
    for k, delay in enumerate(delays):
        nominal = min(4.0, 0.5 * 2**k)
        assert 0.5 * nominal <= delay < 1.5 * nominal
    assert len(set(delays)) == 6


def test_the_breaker_opens_half_opens_for_one_probe_and_closes():
    now = [0.0]
    breaker = CircuitBreaker(failures=3, reset_s=10.0, clock=lambda: now[0])
    for _ in range(2):
        breaker.failed()
    assert breaker.wait_s() == 0.0 and breaker.state == "closed"
    breaker.failed()
    assert breaker.state == "open" and breaker.wait_s() == pytest.approx(10.0)
    now[0] = 10.0
    assert breaker.wait_s() == 0.0 and breaker.state == "half_open"  # the probe
    assert breaker.wait_s() > 0  # everyone else waits for the probe
    breaker.failed()
    assert breaker.state == "open" and breaker.times_opened == 2
    now[0] = 20.0
    assert breaker.wait_s() == 0.0
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.wait_s() == 0.0
