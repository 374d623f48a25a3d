"""The liveness monitor: proven connections, deaths, and what unproven peers cannot do."""

from __future__ import annotations

import socket
import time

import pytest

from relax_hpc.weightsync import liveness, rendezvous

TOKEN = rendezvous.new_token()


@pytest.fixture
def monitor(monkeypatch):
    monkeypatch.setattr(liveness, "HANDSHAKE_S", 0.3)
    monitor = liveness.LivenessMonitor("127.0.0.1", TOKEN)
    yield monitor
    monitor.close()


def _until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the monitor closes ``sock`` (after any nonce it sent) within 5 s."""
    sock.settimeout(5.0)
    try:
        while sock.recv(64):
            pass
    except TimeoutError:
        return False
    return True


def test_a_proven_connection_is_alive_until_it_closes(monitor):
    sock = liveness.connect("127.0.0.1", monitor.port, TOKEN, "e1.a", timeout_s=5.0)
    assert _until(lambda: monitor.is_connected("e1.a"))
    assert not monitor.is_dead("e1.a")
    sock.close()  # what the kernel does when the engine's process dies
    assert _until(lambda: monitor.is_dead("e1.a"))
    assert not monitor.is_connected("e1.a")


def test_a_reconnect_replaces_the_older_connection_without_a_death(monitor):
    first = liveness.connect("127.0.0.1", monitor.port, TOKEN, "e1.a", timeout_s=5.0)
    second = liveness.connect("127.0.0.1", monitor.port, TOKEN, "e1.a", timeout_s=5.0)
    assert _closed_by_peer(first)
    assert monitor.is_connected("e1.a") and not monitor.is_dead("e1.a")
    second.close()


def test_a_wrong_or_replayed_proof_is_closed_and_changes_nothing(monitor):
    live = liveness.connect("127.0.0.1", monitor.port, TOKEN, "e1.a", timeout_s=5.0)
    assert _until(lambda: monitor.is_connected("e1.a"))
    wrong = liveness.connect("127.0.0.1", monitor.port, "f" * 64, "e1.a", timeout_s=5.0)
    replay = socket.create_connection(("127.0.0.1", monitor.port))
    nonce = replay.recv(64).strip().decode()
    replay.sendall(f"e1.a {liveness.alive_proof(TOKEN, 'e1.a', 'an-old-nonce')}\n".encode())
    assert nonce != "an-old-nonce"
    assert _closed_by_peer(wrong) and _closed_by_peer(replay)
    assert monitor.is_connected("e1.a") and not monitor.is_dead("e1.a")
    live.close()


def test_stalled_handshakes_are_closed_and_a_flood_is_capped(monitor, monkeypatch):
    monkeypatch.setattr(liveness, "MAX_PENDING", 8)
    stalled = [socket.create_connection(("127.0.0.1", monitor.port)) for _ in range(20)]
    live = liveness.connect("127.0.0.1", monitor.port, TOKEN, "e1.a", timeout_s=5.0)
    assert _until(lambda: monitor.is_connected("e1.a")), "a flood kept an engine out"
    assert all(_closed_by_peer(sock) for sock in stalled)  # capped, then timed out
    assert monitor.is_connected("e1.a")
    live.close()


def test_one_nudge_wakes_every_waiting_thread_and_each_sees_it_once(monitor):
    """The trainer's loop (waiting for samples) and its background send (waiting for an
    engine's message) wait at once: a nudge is not consumed by whichever wakes first."""
    import threading

    sock = liveness.connect("127.0.0.1", monitor.port, TOKEN, "e1.a", timeout_s=5.0)
    assert _until(lambda: monitor.is_connected("e1.a"))
    woken: list[bool] = []
    waiting = threading.Barrier(3)

    def wait() -> None:
        waiting.wait(timeout=30)
        woken.append(monitor.wait_for_nudge(30.0))

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for thread in threads:
        thread.start()
    waiting.wait(timeout=30)
    liveness.nudge(sock)
    for thread in threads:
        thread.join(timeout=60)
    assert woken == [True, True]
    assert monitor.wait_for_nudge(0.05)  # this thread sees it too, once
    assert not monitor.wait_for_nudge(0.05)
    sock.close()


def test_both_ends_send_a_nudge_at_once_without_nagle(monitor):
    """A nudge is one byte; with Nagle on, one sent while the previous is unacknowledged waits
    for the peer's delayed ACK (measured: engines' result nudges reached the trainer up to
    its 20 ms poll late). Both ends of the connection turn it off."""
    sock = liveness.connect("127.0.0.1", monitor.port, TOKEN, "e1.a", timeout_s=5.0)
    assert _until(lambda: monitor.is_connected("e1.a"))
    trainer_end = monitor._alive["e1.a"]
    for end in (sock, trainer_end):
        assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    sock.close()
