"""The per-tensor transport (``weightsync.transport=sglang_distributed``) over Gloo on loopback.

The trainer side is the real ``PerTensorSender``. The engines are processes whose "SGLang"
is ``per_tensor_peer.StandInSGLangWorker``: it joins and receives exactly as SGLang
0.5.6's tensor-parallel workers do (tcp:// rendezvous, torch's group helper, one broadcast
per tensor from rank 0 into ``torch.empty`` of the manifest's shape and dtype). That
stand-in is used only because SGLang cannot run without CUDA; the real engine is checked
by tests/gpu/test_sglang_engine.py.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

import pytest
import torch
from per_tensor_peer import spawn_per_tensor_engine
from weightsync_peers import expected_fingerprint, make_state, read_status, stop_engines, wait_until

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import PerTensorSender, WeightSyncConfig
from relax_hpc.weightsync import rendezvous as rdv

STARTUP_S = 60  # an engine process imports torch on 2 loaded cores


@pytest.fixture
def config() -> WeightSyncConfig:
    return WeightSyncConfig(
        backend="gloo",
        timeout_s=5.0,
        serve_dtype="bfloat16",
        fs_fallback=False,
        advertise_host="127.0.0.1",
        transport="sglang_distributed",
    )


@pytest.fixture
def run(tmp_path, config, caplog):
    caplog.set_level(logging.INFO, logger="relax_hpc.weightsync")
    paths = RunPaths(tmp_path).create()
    processes = []

    def start(engine_ids: list[str], mode: str = "normal", sender_class=PerTensorSender):
        sender = sender_class(paths, config, "cpu")
        sender.start()
        processes.extend(spawn_per_tensor_engine(tmp_path, e, config, mode) for e in engine_ids)

        def all_admitted() -> bool:
            sender.admit_pending()
            return set(engine_ids) <= set(sender.admitted_engines)

        wait_until(all_admitted, STARTUP_S, f"admission of {engine_ids}")
        return sender

    yield paths, start
    stop_engines(tmp_path, processes)


def _await_event(root, engine_id: str, event: str, **match) -> dict:
    def seen() -> dict | None:
        for record in read_status(root, engine_id):
            if record["event"] == event and all(record.get(k) == v for k, v in match.items()):
                return record
        return None

    return wait_until(seen, 30, f"{engine_id}: {event} {match}")


def test_two_engines_receive_every_tensor_exactly_in_the_serving_dtype(run):
    paths, start = run
    sender = start(["e1", "e2"])
    generations = []
    for version in (1, 2):
        report = sender.sync(make_state(version), version)
        assert sorted(report.members) == ["e1", "e2"], report
        assert report.failed == report.dropped == []
        generations.append(report.generation)
        for engine_id in ("e1", "e2"):
            record = _await_event(paths.root, engine_id, "update", version=version)
            # floats arrive as bf16, int64 unchanged, every byte equal (crc over all tensors)
            assert record["fingerprint"] == expected_fingerprint(version, torch.bfloat16)
    joins = {e: _await_event(paths.root, e, "joined_group") for e in ("e1", "e2")}
    assert sorted(j["rank"] for j in joins.values()) == [1, 2]
    assert {j["world_size"] for j in joins.values()} == {3}
    assert generations == [generations[0]] * 2, "an unchanged membership reuses its group"
    assert report.num_bytes == sum(
        t.numel() * (t.element_size() if not t.is_floating_point() else 2)
        for t in make_state(2).values()
    )
    sender.close()


class _ForgingSender(PerTensorSender):
    """Signs the plan of sync 1 with another token and sends sync 2's unsigned."""

    def _sign(self, body: dict) -> str:
        if body["manifest"]["policy_version"] == 1:
            return json.dumps({"body": body, "sig": rdv.sign("f" * 64, b"anything")})
        if body["manifest"]["policy_version"] == 2:
            return json.dumps({"body": body})
        return super()._sign(body)


def test_forged_or_unsigned_plans_are_refused_before_sglang_is_called(run):
    paths, start = run
    sender = start(["e1"], sender_class=_ForgingSender)
    for version in (1, 2):
        report = sender.sync(make_state(version), version)
        assert report.failed == ["e1"] and report.members == [], report
    events = [r["event"] for r in read_status(paths.root, "e1")]
    assert "joined_group" not in events and "received" not in events
    report = sender.sync(make_state(3), 3)
    assert report.members == ["e1"], "a correctly signed plan is accepted afterwards"
    record = _await_event(paths.root, "e1", "update", version=3)
    assert record["fingerprint"] == expected_fingerprint(3, torch.bfloat16)
    sender.close()


def test_a_peer_dying_mid_broadcast_costs_the_sender_a_bounded_time(run, config):
    paths, start = run
    sender = start(["e1"], mode="die_mid_broadcast")
    began = time.monotonic()
    report = sender.sync(make_state(1), 1)
    seconds = time.monotonic() - began
    _await_event(paths.root, "e1", "dying")
    assert report.members == [] and report.dropped == ["e1"], report
    # ready + group + broadcast + results, each bounded by timeout_s; no hang
    assert seconds < 4 * config.timeout_s + 5, seconds
    sender.close()


def test_a_bucket_receiver_is_dropped_not_sent_to(run, tmp_path, config):
    from weightsync_peers import spawn_engine

    paths, start = run
    sender = start([])
    bucket_config = replace(config, transport="buckets")
    process = spawn_engine(tmp_path, "old", bucket_config)
    try:

        def admitted() -> bool:
            sender.admit_pending()
            return "old" in sender.admitted_engines

        wait_until(admitted, STARTUP_S, "admission of a bucket engine")
        report = sender.sync(make_state(1), 1)
        assert report.dropped == ["old"] and report.members == []
    finally:
        stop_engines(tmp_path, [process])
    sender.close()
