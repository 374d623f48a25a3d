"""Weight sync between a trainer (this process) and engine processes, over Gloo on loopback.

Every wait is on a condition (a status line, an admission, a report), bounded in time.
"""

from __future__ import annotations

import logging
from dataclasses import replace

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

from relax_hpc.observe.metrics import LogThrottle
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.weightsync import WeightSender, WeightSyncConfig
from relax_hpc.weightsync.fs_export import latest_published_version

STARTUP_S = 60  # an engine process imports torch on 2 loaded cores


@pytest.fixture
def config() -> WeightSyncConfig:
    return WeightSyncConfig(
        backend="gloo",
        timeout_s=5.0,
        bucket_mb=1,
        serve_dtype="bfloat16",
        fs_fallback=False,
        advertise_host="127.0.0.1",
    )


@pytest.fixture
def run(tmp_path, config, caplog):
    """A started sender and a list the test appends its engine processes to."""
    caplog.set_level(logging.INFO, logger="relax_hpc.weightsync")
    paths = RunPaths(tmp_path).create()
    processes = []

    def make_sender(cfg: WeightSyncConfig = config, sender_class=WeightSender) -> WeightSender:
        sender = sender_class(paths, cfg, "cpu")
        sender.start()
        return sender

    yield paths, processes, make_sender
    stop_engines(tmp_path, processes)


def _await_admitted(sender: WeightSender, engine_ids: list[str]) -> None:
    def all_admitted() -> bool:
        sender.admit_pending()
        return set(engine_ids) <= set(sender.admitted_engines)

    wait_until(all_admitted, STARTUP_S, f"admission of {engine_ids}")


def _await_update(root, engine_id: str, version: int) -> dict:
    def update_seen() -> dict | None:
        for record in read_status(root, engine_id):
            if record["event"] in ("update", "joined") and record["version"] == version:
                return record
        return None

    return wait_until(update_seen, 30, f"{engine_id} at policy_version {version}")


def _events(paths: RunPaths, name: str) -> list[dict]:
    return [read_json(p) for p in sorted(paths.events_dir.glob(f"*-{name}-*.json"))]


def test_two_engines_sync_several_versions(run, config):
    paths, processes, make_sender = run
    sender = make_sender()
    processes += [spawn_engine(paths.root, e, config) for e in ("e1", "e2")]
    _await_admitted(sender, ["e1", "e2"])
    generations = []
    for version in (1, 2, 3):
        report = sender.sync(make_state(version), version)
        assert sorted(report.members) == ["e1", "e2"]
        assert report.failed == report.dropped == []
        assert report.num_bytes >= 2 * 1024 * 512 * 2  # bf16 on the wire
        generations.append(report.generation)
        for engine_id in ("e1", "e2"):
            record = _await_update(paths.root, engine_id, version)
            assert record["fingerprint"] == expected_fingerprint(version, torch.bfloat16)
    assert generations == [generations[0]] * 3, "an unchanged membership reuses its group"
    sender.close()


def test_the_per_sync_log_line_is_throttled_but_never_for_an_unusual_sync(run, config, caplog):
    paths, processes, make_sender = run
    sender = make_sender()
    sender._log_lines = LogThrottle(clock=lambda: 0.0)  # a frozen clock: the first 10 only
    processes.append(spawn_engine(paths.root, "e1", config))
    _await_admitted(sender, ["e1"])
    for version in range(1, 13):
        assert sender.sync(make_state(version), version).members == ["e1"]
    sender.sync(make_state(12), 12, only=["e1"])  # a joiner's catch-up: always logged
    lines = [r.getMessage() for r in caplog.records if "engines in" in r.getMessage()]
    assert len(lines) == 11, lines
    assert "policy_version 10 -> 1 engines" in lines[9]
    assert "policy_version 12 -> " in lines[10]
    sender.close()


def test_late_joiner_loads_published_weights_then_joins_broadcasts(run, config):
    paths, processes, make_sender = run
    sender = make_sender(replace(config, fs_every_syncs=1))
    processes.append(spawn_engine(paths.root, "e1", config))
    _await_admitted(sender, ["e1"])
    first = sender.sync(make_state(1), 1)
    second = sender.sync(make_state(2), 2)
    assert first.members == second.members == ["e1"]
    assert latest_published_version(paths) == 2

    processes.append(spawn_engine(paths.root, "late", config))
    joined = _await_update(paths.root, "late", 2)
    assert joined["event"] == "joined", "the joiner starts from weights/v2 before any broadcast"
    assert joined["fingerprint"] == expected_fingerprint(2, torch.bfloat16)
    _await_admitted(sender, ["late"])
    third = sender.sync(make_state(3), 3)
    assert sorted(third.members) == ["e1", "late"]
    assert third.generation != second.generation, "a new member re-forms the group"
    for engine_id in ("e1", "late"):
        record = _await_update(paths.root, engine_id, 3)
        assert record["fingerprint"] == expected_fingerprint(3, torch.bfloat16)
    sender.close()


def test_engine_killed_mid_broadcast_is_dropped_and_others_finish(run, config, caplog):
    paths, processes, make_sender = run
    cfg = replace(config, timeout_s=3.0)
    sender = make_sender(cfg)
    survivor = spawn_engine(paths.root, "e1", cfg)
    victim = spawn_engine(paths.root, "e2", cfg, mode="die_after_v1")
    processes += [survivor, victim]
    _await_admitted(sender, ["e1", "e2"])
    assert sorted(sender.sync(make_state(1), 1).members) == ["e1", "e2"]

    report = sender.sync(make_state(2), 2)
    assert report.members == ["e1"]
    assert report.dropped == ["e2"]
    # ready (live) + broadcast (gloo timeout) + results grace + a retry round, with slack
    assert report.seconds < 4 * cfg.timeout_s + 5
    assert victim.wait(timeout=30) == -9
    record = _await_update(paths.root, "e1", 2)
    assert record["fingerprint"] == expected_fingerprint(2, torch.bfloat16)
    dropped = _events(paths, "weightsync_peer_dropped")
    assert [event["engine_id"] for event in dropped] == ["e2"]
    assert "DROPPED engine e2" in caplog.text
    assert sender.sync(make_state(3), 3).members == ["e1"], "the group re-forms without e2"
    sender.close()


class _CorruptingSender(WeightSender):
    """Flips a byte of bucket 1 after its checksum was taken, for policy_version 2."""

    corrupt_version = 2

    def _before_send(self, bucket: int, buffer: torch.Tensor) -> None:
        if self._corrupting and bucket == 1:
            buffer[17] ^= 0xFF

    def sync(self, named_tensors, policy_version):
        self._corrupting = policy_version == self.corrupt_version
        return super().sync(named_tensors, policy_version)


def test_corrupted_payload_is_rejected_and_receiver_fails_closed(run, config):
    paths, processes, make_sender = run
    sender = make_sender(sender_class=_CorruptingSender)
    processes += [spawn_engine(paths.root, e, config) for e in ("e1", "e2")]
    _await_admitted(sender, ["e1", "e2"])
    assert sorted(sender.sync(make_state(1), 1).members) == ["e1", "e2"]

    report = sender.sync(make_state(2), 2)
    assert report.members == []
    assert sorted(report.failed) == ["e1", "e2"]
    for engine_id in ("e1", "e2"):
        closed = wait_until(
            lambda e=engine_id: [
                r for r in read_status(paths.root, e) if r["event"] == "ready" and not r["value"]
            ],
            30,
            f"{engine_id} to fail closed",
        )
        assert closed[0]["version"] == 1, "the old weights are kept"
        assert "checksum mismatch" in closed[0]["reason"]
    assert len(_events(paths, "weightsync_verification_failed")) == 2

    report = sender.sync(make_state(3), 3)
    assert sorted(report.members) == ["e1", "e2"], "a verified version reopens the engines"
    for engine_id in ("e1", "e2"):
        record = _await_update(paths.root, engine_id, 3)
        assert record["fingerprint"] == expected_fingerprint(3, torch.bfloat16)
    sender.close()


def test_engine_with_wrong_token_is_refused(run, config):
    paths, processes, make_sender = run
    sender = make_sender()
    good = spawn_engine(paths.root, "good", config)
    bad = spawn_engine(paths.root, "intruder", config, mode="wrong_token")
    processes += [good, bad]

    def refused() -> list[str]:
        return sender.admit_pending()[1]

    assert wait_until(refused, STARTUP_S, "the intruder to be refused") == ["intruder"]
    _await_admitted(sender, ["good"])
    assert bad.wait(timeout=30) == 3
    record = [r for r in read_status(paths.root, "intruder") if r["event"] == "refused"][0]
    assert "token mismatch" in record["error"]
    assert [e["engine_id"] for e in _events(paths, "weightsync_peer_refused")] == ["intruder"]

    report = sender.sync(make_state(1), 1)
    assert report.members == ["good"]
    assert "intruder" not in sender.admitted_engines
    sender.close()


def test_an_engine_busy_generating_is_waited_for_and_a_stopped_one_dropped(run, config):
    """An alive engine answers a call after it finished its batch (async overlap): it is
    served although that took longer than timeout_s; one that is stopped (hung, its
    connection open) is dropped after busy_timeout_s, not waited for forever."""
    import os
    import signal
    import time

    paths, processes, make_sender = run
    cfg = replace(config, timeout_s=1.0, busy_timeout_s=8.0, busy_steps=0, busy_floor_s=1.0)
    sender = make_sender(cfg)
    processes.append(spawn_engine(paths.root, "busy", cfg, mode="busy:3"))
    _await_admitted(sender, ["busy"])
    assert sender.sync(make_state(1), 1).members == ["busy"]
    began = time.monotonic()
    report = sender.sync(make_state(2), 2)  # the engine attends it 3 s after version 1
    assert report.members == ["busy"] and not report.dropped, report
    assert time.monotonic() - began > 2 * cfg.timeout_s
    assert _await_update(paths.root, "busy", 2)["fingerprint"] == expected_fingerprint(
        2, torch.bfloat16
    )

    os.kill(processes[0].pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        report = sender.sync(make_state(3), 3)
        seconds = time.monotonic() - began
    finally:
        os.kill(processes[0].pid, signal.SIGCONT)
    assert report.dropped == ["busy"], report
    assert cfg.busy_timeout_s <= seconds < cfg.busy_timeout_s + 4 * cfg.timeout_s + 5, seconds
    sender.close()


def test_a_stopped_engine_costs_one_round_bounded_by_the_step_time_and_rejoins(run, config):
    """A SIGSTOPped engine keeps its liveness connection open. The round waits for it only
    busy_steps times the recent step time (not busy_timeout_s), drops it, and the next
    round does not wait for it at all; continued, it comes back through the joiner path."""
    import os
    import signal
    import time

    paths, processes, make_sender = run
    cfg = replace(config, timeout_s=1.0, busy_timeout_s=600.0, busy_steps=3.0, busy_floor_s=1.0)
    step_s = 1.0  # what the test's "training step" between two syncs takes
    sender = make_sender(cfg)
    processes += [spawn_engine(paths.root, e, cfg) for e in ("steady", "stopped")]
    _await_admitted(sender, ["steady", "stopped"])
    for version in (1, 2, 3):
        assert sorted(sender.sync(make_state(version), version).members) == ["steady", "stopped"]
        time.sleep(step_s)

    os.kill(processes[1].pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        report = sender.sync(make_state(4), 4)
        waited_s = time.monotonic() - began
        assert report.members == ["steady"] and report.dropped == ["stopped"], report
        # at least 3 steps of >= 1 s; far below busy_timeout_s (generous for 2 loaded cores)
        assert 3 * step_s <= waited_s < 60, waited_s
        time.sleep(step_s)
        began = time.monotonic()
        report = sender.sync(make_state(5), 5)
        assert report.members == ["steady"] and not report.dropped, report
        assert time.monotonic() - began < 3 * step_s, "waited for the dropped engine again"
    finally:
        os.kill(processes[1].pid, signal.SIGCONT)

    # running again, it reads its drop notice and registers anew: a joiner
    joiners = wait_until(sender.admit_joiners, STARTUP_S, "the continued engine's new join")
    caught_up = sender.sync(make_state(5), 5, only=joiners)  # the trainer's catch-up
    assert caught_up.members == ["stopped"], caught_up
    assert _await_update(paths.root, "stopped", 5)["fingerprint"] == expected_fingerprint(
        5, torch.bfloat16
    )
    report = sender.sync(make_state(6), 6)
    assert sorted(report.members) == ["steady", "stopped"] and not report.dropped, report
    sender.close()
