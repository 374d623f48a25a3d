"""Admission before identity: peers without the token change nothing for an admitted engine.

A live engine ``e1`` is admitted and synced; then an intruder process (no token, but the
trainer's address, start instance and ``e1``'s member id) tries a wrong token under e1's
name, a replayed proof, truncated handshakes, and a flood of registrations and
connections. Afterwards e1 is still the same admitted member, in the same group
generation, with its liveness connection, never dropped, and it receives every version.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from weightsync_peers import (
    expected_fingerprint,
    make_state,
    read_status,
    spawn_engine,
    stop_engines,
    wait_until,
)

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.weightsync import WeightSender, WeightSyncConfig, rendezvous

INTRUDER = Path(__file__).with_name("weightsync_intruders.py")
STARTUP_S = 60


@pytest.fixture
def live_engine(tmp_path):
    """A started sender and an admitted engine ``e1`` that received version 1."""
    paths = RunPaths(tmp_path).create()
    config = WeightSyncConfig(
        backend="gloo", timeout_s=10.0, bucket_mb=1, fs_fallback=False, advertise_host="127.0.0.1"
    )
    sender = WeightSender(paths, config, "cpu")
    sender.start()
    processes = [spawn_engine(paths.root, "e1", config)]
    _admit(sender, ["e1"])
    first = sender.sync(make_state(1), 1)
    assert first.members == ["e1"]
    yield paths, config, sender, processes, first.generation
    sender.close()
    stop_engines(paths.root, processes)


def _admit(sender: WeightSender, engine_ids: list[str]) -> None:
    def admitted() -> bool:
        sender.admit_pending()
        return set(engine_ids) <= set(sender.admitted_engines)

    wait_until(admitted, STARTUP_S, f"admission of {engine_ids}")


def _member(sender: WeightSender, engine_id: str) -> str:
    (member,) = [m for m, reg in sender._admitted.items() if reg.engine_id == engine_id]
    return member


def _intrude(paths: RunPaths, sender: WeightSender, action: str) -> subprocess.Popen:
    endpoint = rendezvous.read_trainer_endpoint(paths)
    args = [action, str(paths.root), endpoint.host, str(endpoint.port), endpoint.instance]
    args += [_member(sender, "e1"), str(getattr(endpoint, "liveness_port", 0))]
    return subprocess.Popen(
        [sys.executable, str(INTRUDER), *args], stdout=subprocess.PIPE, text=True
    )


def _judge_until_done(sender: WeightSender, intruder: subprocess.Popen) -> dict:
    """Let the trainer judge registrations while the intruder runs; its report."""
    wait_until(
        lambda: sender.admit_pending() is not None and intruder.poll() is not None,
        120,
        "the intruder to finish",
    )
    assert intruder.returncode == 0
    return json.loads(intruder.stdout.read().splitlines()[-1])


def _assert_unchanged(paths, sender, member: str, generation: int, version: int) -> None:
    """e1 is the same member, in the same group, and switches to ``version``."""
    report = sender.sync(make_state(version), version)
    assert report.members == ["e1"] and report.dropped == [], report
    assert _member(sender, "e1") == member, "e1 was evicted and came back as another member"
    assert report.generation == generation, "the group was re-formed"
    if hasattr(sender, "_liveness"):
        assert sender._admission.is_connected(member)
    dropped = list(paths.events_dir.glob("*-weightsync_peer_dropped-*.json"))
    assert dropped == [], [read_json(p) for p in dropped]

    def switched() -> list:
        return [r for r in read_status(paths.root, "e1") if r.get("version") == version]

    record = [r for r in wait_until(switched, 30, f"e1 at {version}") if "fingerprint" in r]
    assert record[-1]["fingerprint"] == expected_fingerprint(version, torch.bfloat16)


def _refusals(paths: RunPaths) -> list[dict]:
    return [read_json(p) for p in sorted(paths.events_dir.glob("*-weightsync_peer_refused-*"))]


def _wrong_token(paths, sender) -> None:
    """Intrusions return None, or what to do once e1 was synced while they go on."""
    seen = _judge_until_done(sender, _intrude(paths, sender, "wrong_token"))
    assert seen["answer"]["ok"] is False and "token mismatch" in seen["answer"]["reason"]
    assert [e["engine_id"] for e in _refusals(paths)] == ["e1"]


def _replay(paths, sender) -> None:
    seen = _judge_until_done(sender, _intrude(paths, sender, "replay"))
    assert seen["as_new"]["ok"] is False, "a proof bound to another member id was accepted"
    sender.admit_pending()  # sees e1's file gone (the intruder removed it under e1's name)


def _truncated(paths, sender) -> None:
    seen = _judge_until_done(sender, _intrude(paths, sender, "truncated"))
    assert seen["half_hello"]["ok"] is False
    if seen["liveness_closed"]:
        assert seen["liveness_closed"] == {"forged": True, "stalled": True}


def _flood(paths, sender):
    intruder = _intrude(paths, sender, "flood")
    flooding = json.loads(intruder.stdout.readline())  # registrations and connections are up
    num_refused = len(_refusals(paths))

    def finish() -> None:
        (paths.root / "test_status" / "stop_flood").touch()
        _judge_until_done(sender, intruder)
        assert len(_refusals(paths)) == num_refused + 100
        print(f"flood: 100 registrations refused, {flooding['flooding']} connections held")

    return finish


@pytest.mark.slow
def test_peers_without_the_token_change_nothing_for_an_admitted_engine(live_engine):
    """One live engine, four intruders in turn (a wrong token under e1's name, a replayed
    proof, truncated handshakes, a flood); after each, e1 is unchanged and synced."""
    paths, _, sender, _, generation = live_engine
    member = _member(sender, "e1")
    for version, intrusion in enumerate((_wrong_token, _replay, _truncated, _flood), start=2):
        finish = intrusion(paths, sender)
        _assert_unchanged(paths, sender, member, generation, version)
        if finish is not None:
            finish()


def test_a_second_admitted_engine_with_a_live_id_is_refused_with_an_event(live_engine):
    paths, config, sender, processes, generation = live_engine
    member = _member(sender, "e1")
    twin = spawn_engine(paths.root, "e1", config)  # the run's token, e1's id: a copy of e1
    processes.append(twin)
    wait_until(lambda: sender.admit_pending() and twin.poll() is not None, STARTUP_S, "refusal")
    assert twin.returncode == 3
    (event,) = _refusals(paths)
    assert event["engine_id"] == "e1" and "duplicate engine id" in event["reason"]
    assert member in event["reason"], "the event names the live engine holding the id"
    _assert_unchanged(paths, sender, member, generation, 2)


def test_an_engine_restarted_after_its_death_takes_its_id_back(live_engine):
    paths, config, sender, processes, _ = live_engine
    old = _member(sender, "e1")
    processes[0].send_signal(signal.SIGKILL)
    processes[0].wait()
    os.replace(paths.root / "test_status" / "e1.jsonl", paths.root / "test_status" / "e1.0")
    processes.append(spawn_engine(paths.root, "e1", config))
    wait_until(lambda: sender.admit_pending() and _member(sender, "e1") != old, STARTUP_S, "e1")
    report = sender.sync(make_state(2), 2)
    assert report.members == ["e1"], report
    (event,) = [read_json(p) for p in paths.events_dir.glob("*-weightsync_peer_dropped-*")]
    assert event["member"] == old and "replaced" in event["reason"]
