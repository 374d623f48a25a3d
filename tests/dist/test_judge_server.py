"""The judge in its own process, over HTTP: one protocol with remote endpoints, admission by
the run's token, a retried request judged once, and a judge killed mid-run found again
after its restart with nothing lost or judged twice."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from reward_fixtures import train_yes_judge

from relax_hpc.config import write_resolved_config
from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.rewards import ClientConfig
from relax_hpc.config.schema import JudgeConfig, ModelConfig
from relax_hpc.judge.server import MAX_BODY_BYTES, JudgeServer
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.rollout.rewards.judge_address import (
    new_judge_address,
    publish_judge_address,
    read_judge_addresses,
)
from relax_hpc.rollout.rewards.remote import JudgeTargets, RemoteScorer
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_judge_engine_scorer

PEER = Path(__file__).with_name("judge_peer.py")
REPO = Path(__file__).resolve().parents[2]
CLIENT = ClientConfig(
    timeout_s=5.0,
    batch_size=8,
    max_attempts=30,
    backoff_s=0.05,
    backoff_max_s=0.3,
    breaker_failures=1000,
    max_wait_s=120.0,
)


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory) -> Path:
    """A tiny judge that answers "yes" to additions, saved as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("judge") / "yes-judge"
    model, tokenizer = train_yes_judge()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def judge_config(folder: Path) -> JudgeConfig:
    return JudgeConfig(
        model=ModelConfig(name="yes-judge", path=str(folder), tokenizer="auto"),
        placement="component",
        template="addition_verifier",
        apply_chat_template=False,
        max_new_tokens=4,
        client=CLIENT,
    )


def items(count: int, start: int = 0) -> list[ScoreItem]:
    return [ScoreItem(str(n), "", {}, f"{n}+0=") for n in range(start, start + count)]


class SlowScorer:
    """The real judge, made to take ``delay_s`` per batch (a big judge on a busy GPU)."""

    def __init__(self, scorer, delay_s: float) -> None:
        self.scorer, self.delay_s = scorer, delay_s

    def score(self, batch):
        time.sleep(self.delay_s)
        return self.scorer.score(batch)

    def close(self):
        self.scorer.close()


@pytest.fixture
def served(tmp_path, judge_folder):
    """A judge server in this process whose address is published in a run directory."""
    paths = RunPaths(tmp_path / "run").create()
    scorer = build_judge_engine_scorer(judge_config(judge_folder), RewardContext(seed=0))
    started = []

    def serve(delay_s: float = 0.0, **bounds) -> JudgeServer:
        address = new_judge_address("127.0.0.1", 0)
        server = JudgeServer(
            SlowScorer(scorer, delay_s),
            address.token,
            "127.0.0.1",
            0,
            instance=address.instance,
            **bounds,
        ).start()
        publish_judge_address(paths, replace(address, port=server.port))
        started.append(server)
        return server

    yield paths, serve
    for server in started:
        server.stop()


def test_the_rollouts_client_scores_through_the_judge_server(served):
    paths, serve = served
    server = serve()
    client = RemoteScorer("judge", JudgeTargets(paths), CLIENT)
    results = client.score(items(20))
    assert [r.score for r in results] == [1.0] * 20
    assert all(r.details["judge_answer"] == "yes" for r in results)
    assert server.counts.scored == 20 and server.counts.refused == 0
    (address,) = read_judge_addresses(paths)
    assert os.stat(paths.judge_address_file(0)).st_mode & 0o777 == 0o600
    health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{address.port}/v1/health"))
    assert health == {"protocol": "relax_hpc.reward/1", "instance": address.instance, "ready": True}


def test_a_client_without_the_runs_token_is_refused_and_nothing_is_judged(served):
    paths, serve = served
    server = serve()
    (address,) = read_judge_addresses(paths)
    publish_judge_address(paths, replace(address, token="another-runs-token"))
    results = RemoteScorer("judge", JudgeTargets(paths), CLIENT).score(items(3))
    assert results[0].failed.startswith("judge refused the request: HTTP 401 Unauthorized")
    request = urllib.request.Request(address.url, data=b"{}", method="POST")  # unsigned
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(request)
    assert server.counts.scored == 0 and server.counts.refused == 2


class _SlowToRefuse(JudgeServer):
    """Refuses like the judge, after a pause: a refusal still being answered at the stop."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refusing = threading.Event()

    def refuse(self, status: int, reason: str) -> tuple[int, bytes]:
        self.refusing.set()
        time.sleep(0.3)
        return super().refuse(status, reason)


def test_a_request_answered_at_the_stop_is_counted_before_stop_returns(judge_folder):
    """The final status is written right after ``stop``: an answer given meanwhile must be in
    the counts by then (handler threads are daemons that ``server_close`` does not join)."""
    scorer = build_judge_engine_scorer(judge_config(judge_folder), RewardContext(seed=0))
    server = _SlowToRefuse(scorer, "token", "127.0.0.1", 0).start()
    request = urllib.request.Request(
        f"http://127.0.0.1:{server.port}/v1/score", data=b"{}", method="POST"
    )  # unsigned: refused
    codes = []

    def post() -> None:
        try:
            urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as error:
            codes.append(error.code)

    client = threading.Thread(target=post)
    client.start()
    assert server.refusing.wait(10)
    server.stop()
    assert server.counts.refused == 1
    client.join(10)
    assert codes == [401]  # and the answer reached the client


def test_a_request_retried_after_a_timeout_is_judged_once(served):
    paths, serve = served
    server = serve(delay_s=1.0)
    impatient = replace(CLIENT, timeout_s=0.4, batch_size=64)
    client = RemoteScorer("judge", JudgeTargets(paths), impatient)
    results = client.score(items(6))
    assert [r.score for r in results] == [1.0] * 6
    assert client.metrics()["retries_total"] >= 2  # it did time out and retry
    assert server.counts.scored == 6  # the retries joined the scoring in flight


def half_request(port: int) -> socket.socket:
    """A connection that sends half a request line and then waits."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/sc")
    return sock


def wait_until_cut(sock: socket.socket, timeout_s: float) -> None:
    sock.settimeout(timeout_s)
    try:
        assert sock.recv(1024) == b""
    except ConnectionResetError:
        pass
    finally:
        sock.close()


def wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def status_of(port: int, head: bytes) -> int:
    """The status the server answers to ``head`` (a request line and headers, no body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        return int(sock.makefile("rb").readline().split()[1])


def test_idle_half_requests_are_cut_within_the_deadline_with_threads_bounded(served):
    _, serve = served
    server = serve(read_deadline_s=1.0, max_reading=16)
    before = threading.active_count()
    started = time.monotonic()
    sockets, most_threads = [], 0
    for _ in range(300):
        sockets.append(half_request(server.port))
        most_threads = max(most_threads, threading.active_count())
    for sock in sockets:  # every one is cut: the oldest pushed out, the rest at the deadline
        wait_until_cut(sock, timeout_s=max(0.1, started + 20.0 - time.monotonic()))
    assert time.monotonic() - started < 1.0 + 10.0  # opening 300 took most of it
    assert most_threads <= before + 16 + 4  # one thread per reading connection, no more
    # Each handler thread forgets its connection just after the peer saw the cut.
    assert wait_for(lambda: server.guard.counts() == (0, 0), timeout_s=5.0), server.guard.counts()
    assert server.guard.cut >= 300 - 16  # the reaper's: the read timeout is a later backstop


def test_an_oversized_unsigned_body_is_refused_before_it_is_read(served):
    _, serve = served
    server = serve()
    size = 60 << 20
    for signature in ("", "X-Relax-Signature: sha256=" + "0" * 64 + "\r\n"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            head = f"POST /v1/score HTTP/1.1\r\n{signature}Content-Length: {size}\r\n\r\n"
            sock.sendall(head.encode())
            assert int(sock.makefile("rb").readline().split()[1]) == 413  # before any body
            sent, chunk = 0, b"x" * (1 << 20)
            with pytest.raises(OSError):  # the server closed: the body cannot be delivered
                while sent < size:
                    sent += sock.send(chunk)
            assert sent < 24 << 20  # socket buffers at most: the server never read the body
    unsigned = f"POST /v1/score HTTP/1.1\r\nContent-Length: {MAX_BODY_BYTES}\r\n\r\n"
    assert status_of(server.port, unsigned.encode()) == 401  # within the limit: unread too
    assert server.counts.refused == 3 and server.counts.scored == 0


def test_a_malformed_request_gets_400_and_no_traceback(served, capfd, caplog):
    _, serve = served
    server = serve()
    for length in ("abc", "-5", "1e3", ""):
        head = f"POST /v1/score HTTP/1.1\r\nContent-Length: {length}\r\n\r\n".encode()
        assert status_of(server.port, head) == 400
    assert status_of(server.port, b"POST /v1/score HTTP/1.1\r\n\r\n") == 400  # no length
    assert status_of(server.port, b"GARBAGE\r\n\r\n") == 400  # bad request line
    assert "Traceback" not in capfd.readouterr().err
    assert not [record for record in caplog.records if record.exc_info]


def test_a_signed_request_is_answered_while_the_port_is_flooded(served):
    paths, serve = served
    server = serve(read_deadline_s=1.0, max_reading=16)
    done = threading.Event()
    opened = []

    def flood() -> None:
        deadline = time.monotonic() + 60.0
        while not done.is_set() and time.monotonic() < deadline and len(opened) < 5000:
            with contextlib.suppress(OSError):
                opened.append(half_request(server.port))
            while len(opened) > 200:
                opened.pop(0).close()

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        time.sleep(0.5)
        results = RemoteScorer("judge", JudgeTargets(paths), CLIENT).score(items(8))
    finally:
        done.set()
        flooder.join()
        for sock in opened:
            sock.close()
    assert [r.score for r in results] == [1.0] * 8
    assert server.guard.cut > 16  # the flood was there, and was cut


def start_peer(run_dir: Path, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RELAX_HPC_RANK": "0",
        "RELAX_HPC_WORLD_SIZE": "1",
    }
    with open(log, "a") as out:
        return subprocess.Popen(
            [sys.executable, str(PEER), str(run_dir)], stdout=out, stderr=subprocess.STDOUT, env=env
        )


def wait_for_instance(paths: RunPaths, not_this: str | None, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = read_judge_addresses(paths)
        if found and found[0].instance != not_this:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no judge address after {timeout_s} s")


@pytest.fixture
def peers():
    """Judge processes of a test, killed at its end whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_a_judge_killed_mid_run_is_found_again_after_its_restart(tmp_path, judge_folder, peers):
    cfg = compose_run_config(["+experiment=grpo_tiny"])
    paths = RunPaths(tmp_path / "run").create()
    write_resolved_config(replace(cfg, judge=judge_config(judge_folder)), paths.resolved_config)
    log = tmp_path / "judge.log"
    peers.append(start_peer(paths.root, log))
    before = wait_for_instance(paths, None)
    client = RemoteScorer("judge", JudgeTargets(paths), CLIENT)
    assert [r.score for r in client.score(items(16))] == [1.0] * 16

    peers[0].send_signal(signal.SIGKILL)  # no goodbye: its address file stays behind
    peers[0].wait()
    outcome: dict = {}
    batch = threading.Thread(target=lambda: outcome.update(results=client.score(items(24, 100))))
    batch.start()  # the rollout goes on scoring against a dead judge: it waits, retrying
    time.sleep(1.0)
    assert batch.is_alive() and client.metrics()["retries_total"] > 0
    peers.append(start_peer(paths.root, log))
    after = wait_for_instance(paths, before.instance)
    batch.join(timeout=120)
    assert not batch.is_alive()
    results = outcome["results"]
    assert [r.score for r in results] == [1.0] * 24  # nothing lost: all judged after the restart
    assert after.port != before.port or after.pid != before.pid

    peers[1].send_signal(signal.SIGTERM)
    assert peers[1].wait(timeout=60) == 0
    status = read_json(paths.judge_status(0))
    assert status["instance"] == after.instance
    assert status["scored"] == 24 and status["refused"] == 0  # each judged once
    assert read_judge_addresses(paths) == []  # a clean stop withdraws its address
