"""Nudges over the liveness connection wake both sides of a sync, and the trainer waiting
for samples, at once; without them (the notifier gone mid-run) every version and every
shard still arrives, by polling.

``poll_s`` is 1 s here, so a sync that waits for a poll anywhere takes at least a second:
one that wakes on nudges takes milliseconds (the transfer of ~3 MB on loopback).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import torch
from spool_crash_worker import make_group
from weightsync_peers import (
    expected_fingerprint,
    make_state,
    read_status,
    spawn_engine,
    stop_engines,
    wait_until,
)

from relax_hpc.paths import RunPaths
from relax_hpc.spool import ShardWriter, SpoolConfig, SpoolReader
from relax_hpc.weightsync import WeightReceiver, WeightSender, WeightSyncConfig

STARTUP_S = 60  # an engine process imports torch on 2 loaded cores
POLL_S = 1.0
CONFIG = WeightSyncConfig(
    backend="gloo",
    timeout_s=20.0,
    poll_s=POLL_S,
    bucket_mb=1,
    serve_dtype="bfloat16",
    fs_fallback=False,
    advertise_host="127.0.0.1",
)


def admitted(sender: WeightSender, engines: list[str]) -> bool:
    sender.admit_pending()
    return set(engines) <= set(sender.admitted_engines)


def timed_sync(sender: WeightSender, root, engines: list[str], version: int) -> float:
    started = time.monotonic()
    report = sender.sync(make_state(version), version)
    took = time.monotonic() - started
    assert sorted(report.members) == engines and report.dropped == report.failed == []
    for engine_id in engines:
        record = wait_until(
            lambda e=engine_id: next(
                (r for r in read_status(root, e) if r.get("version") == version), None
            ),
            30,
            f"{engine_id} at policy_version {version}",
        )
        assert record["fingerprint"] == expected_fingerprint(version, torch.bfloat16)
    return took


def test_nudges_wake_both_sides_and_polling_still_delivers_without_them(tmp_path):
    paths = RunPaths(tmp_path).create()
    engines = ["e1", "e2"]
    processes = [spawn_engine(paths.root, e, replace(CONFIG)) for e in engines]
    sender = WeightSender(paths, CONFIG, "cpu")
    sender.start()
    try:
        wait_until(lambda: admitted(sender, engines), STARTUP_S, "admission")
        wait_until(lambda: all(sender._admission.is_connected(m) for m in _members(sender)), 30,
                   "liveness connections")  # fmt: skip
        timed_sync(sender, paths.root, engines, 1)  # forms the group
        nudged = [timed_sync(sender, paths.root, engines, v) for v in (2, 3, 4)]
        print(f"syncs woken by nudges: {[round(t, 3) for t in nudged]} s (poll_s {POLL_S})")
        assert max(nudged) < POLL_S / 2, nudged  # no side waited for a poll

        sender._liveness.close()  # the notifier is gone: engines see EOF, the sender polls
        sender._liveness = None
        polled = [timed_sync(sender, paths.root, engines, v) for v in (5, 6)]
        print(f"syncs by polling alone: {[round(t, 3) for t in polled]} s")
        assert min(polled) >= POLL_S / 2, polled  # slower, and nothing was lost
    finally:
        sender.close()
        stop_engines(tmp_path, processes)


def _members(sender: WeightSender) -> list[str]:
    return list(sender._admission.admitted)


def test_a_published_shard_wakes_the_trainer_and_polling_finds_it_without_the_notifier(
    tmp_path,
):
    """The rollout's writer nudges the trainer's spool wait (``spool.poll_s`` 1 s here): a
    shard is taken within milliseconds of its publication; with the notifier gone, at the
    next poll, and nothing is lost."""
    paths = RunPaths(tmp_path).create()
    sender = WeightSender(paths, CONFIG, "cpu")
    sender.start()
    receiver = WeightReceiver(paths, "e1", CONFIG)
    try:
        receiver.join(None)
        wait_until(lambda: admitted(sender, ["e1"]), 30, "admission")
        wait_until(lambda: receiver.poll_for_update(lambda _: None) is None
                   and receiver._liveness is not None, 30, "liveness")  # fmt: skip
        spool = paths.spool_dir
        writer = ShardWriter(spool, "rollout.r0", on_published=receiver.nudge_trainer)
        config = SpoolConfig(poll_s=POLL_S, max_staleness=10)
        reader = SpoolReader(spool, config, sleep=sender.wait_for_engines)
        nudged = [_handoff_s(reader, writer, g) for g in range(3)]
        print(f"hand-offs woken by nudges: {[round(t, 3) for t in nudged]} s (poll_s {POLL_S})")
        assert max(nudged) < POLL_S / 2, nudged

        sender._liveness.close()  # the notifier is gone: the reader polls ready/
        sender._liveness = None
        polled = [_handoff_s(reader, writer, g) for g in range(3, 5)]
        print(f"hand-offs by polling alone: {[round(t, 3) for t in polled]} s")
        assert min(polled) >= POLL_S / 4, polled  # slower, and every group arrived
    finally:
        receiver.close()
        sender.close()


def _handoff_s(reader: SpoolReader, writer: ShardWriter, group_index: int) -> float:
    """Seconds from a shard's publication (0.2 s after the reader started waiting) to the
    reader's return with its group."""
    published_at: list[float] = []

    def publish_later() -> None:
        time.sleep(0.2)
        writer.publish([make_group(0, group_index)])
        published_at.append(time.monotonic())

    thread = threading.Thread(target=publish_later)
    thread.start()
    (group,) = reader.next_batch(1, policy_version=0, timeout_s=30)
    returned_at = time.monotonic()
    thread.join()
    assert group[0].group_id == f"w0-g{group_index}"
    return returned_at - published_at[0]
