"""The trainer's sender in a child process (``weightsync.send_process``), against real engine
processes: versions arrive whole and in order through the shared memory, engines' nudges
reach the trainer's spool wait, the child ignores the step's stop signals, and either side's
death is seen by the other: a dead child fails the trainer's next call with its exit code,
a dead trainer takes the child with it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
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
from relax_hpc.trainer.publish import ChildPublisher
from relax_hpc.weightsync import WeightReceiver, WeightSyncConfig, WeightSyncError
from relax_hpc.weightsync.sender_process import SenderProcess

STARTUP_S = 60  # a process imports torch on 2 loaded cores
CONFIG = WeightSyncConfig(
    backend="gloo",
    timeout_s=20.0,
    poll_s=1.0,  # a wait that needed a poll would take a second: nudges take milliseconds
    bucket_mb=1,
    serve_dtype="bfloat16",
    fs_fallback=False,
    advertise_host="127.0.0.1",
)


def _admit(sender: SenderProcess, count: int) -> None:
    admitted: list[str] = []
    wait_until(lambda: admitted.extend(sender.admit_joiners()) or len(admitted) >= count,
               STARTUP_S, "admission")  # fmt: skip


def _arrived(root, engine_id: str, version: int) -> dict:
    return wait_until(
        lambda: next((r for r in read_status(root, engine_id) if r.get("version") == version), None),
        30,
        f"{engine_id} at policy_version {version}",
    )


def test_versions_reach_engines_through_the_child_and_the_caller_may_change_its_tensors(
    tmp_path,
):
    """The trainer's publisher over the child: ``publish`` returns while the child sends,
    with the previous version's report; the tensors it was handed change right after."""
    paths = RunPaths(tmp_path).create()
    engines = ["e1", "e2"]
    processes = [spawn_engine(paths.root, e, replace(CONFIG)) for e in engines]
    sender = SenderProcess(paths, CONFIG, "cpu")
    sender.start()
    publisher = ChildPublisher(sender, lambda report: {"report": report})
    try:
        _admit(sender, len(engines))
        reports = []
        for version in (1, 2, 3):
            weights = make_state(version)
            reports.append(publisher.publish(weights, version).get("report"))
            for tensor in weights.values():
                tensor.zero_()  # the next optimiser step: the copy in flight must not change
            for engine_id in engines:
                record = _arrived(paths.root, engine_id, version)
                assert record["fingerprint"] == expected_fingerprint(version, torch.bfloat16)
        last = publisher.wait()["report"]
        assert reports[0] is None and [r.policy_version for r in reports[1:]] == [1, 2]
        assert last.policy_version == 3 and sorted(last.members) == engines, last
        now = publisher.publish_now(make_state(4), 4, None)["report"]
        assert now.policy_version == 4 and sorted(now.members) == engines
        with pytest.raises(RuntimeError, match="previous sync was not ended"):
            sender.begin_sync(make_state(5), 5)
            sender.begin_sync(make_state(6), 6)
        assert sender.end_sync().policy_version == 5
    finally:
        sender.close()
        stop_engines(tmp_path, processes)
    assert sender._process is None  # closed and reaped


def test_a_published_shard_nudge_reaches_the_trainer_through_the_child(tmp_path):
    paths = RunPaths(tmp_path).create()
    sender = SenderProcess(paths, CONFIG, "cpu")
    sender.start()
    receiver = WeightReceiver(paths, "e1", CONFIG)
    try:
        sender.sync(make_state(0), 0)  # the child is up and its store published
        receiver.join(None)
        _admit(sender, 1)
        wait_until(lambda: receiver.poll_for_update(lambda _: None) is None
                   and receiver._liveness is not None, 30, "liveness")  # fmt: skip
        writer = ShardWriter(paths.spool_dir, "rollout.r0", on_published=receiver.nudge_trainer)
        reader = SpoolReader(
            paths.spool_dir,
            SpoolConfig(poll_s=CONFIG.poll_s, max_staleness=10),
            sleep=sender.wait_for_engines,
        )
        assert not sender.wait_for_engines(0.05)  # nothing happened: a plain timeout
        for index in range(3):
            started = time.monotonic()
            writer.publish([make_group(0, index)])
            (group,) = reader.next_batch(1, policy_version=0, timeout_s=30)
            took = time.monotonic() - started
            assert group[0].group_id == f"w0-g{index}"
            assert took < CONFIG.poll_s / 2, f"hand-off took {took:.3f} s: no nudge arrived"
    finally:
        receiver.close()
        sender.close()


@contextlib.contextmanager
def _serving(paths: RunPaths) -> Iterator[SenderProcess]:
    """A started ``SenderProcess`` whose child has served one sync (no engines), closed after."""
    sender = SenderProcess(paths, CONFIG, "cpu")
    sender.start()
    try:
        sender.sync(make_state(0), 0)
        yield sender
    finally:
        sender.close()


def test_the_child_ignores_stop_signals_and_its_death_fails_the_next_call(tmp_path):
    with _serving(RunPaths(tmp_path).create()) as sender:
        child = sender._process
        for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            child.send_signal(signum)  # Slurm signals every process of the step
        time.sleep(0.5)
        assert child.poll() is None
        assert sender.sync(make_state(1), 1).policy_version == 1  # still serving
        child.kill()
        child.wait()
        with pytest.raises(WeightSyncError, match=r"weight-send process .* exit code -9"):
            sender.sync(make_state(2), 2)


PARENT = textwrap.dedent(
    """
    import sys, time
    from relax_hpc.paths import RunPaths
    from relax_hpc.weightsync import WeightSyncConfig
    from relax_hpc.weightsync.sender_process import SenderProcess
    from weightsync_peers import make_state
    config = WeightSyncConfig(backend="gloo", fs_fallback=False, advertise_host="127.0.0.1")
    sender = SenderProcess(RunPaths(sys.argv[1]).create(), config, "cpu")
    sender.start()
    sender.sync(make_state(0), 0)
    print("child", sender._process.pid, flush=True)
    time.sleep(600)
    """
)


def test_a_trainer_killed_outright_takes_the_child_with_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        lines = iter(parent.stdout.readline, "")  # the child logs to the same stdout
        child_pid = int(next(line for line in lines if line.startswith("child ")).split()[1])
        assert _alive(child_pid)
        parent.kill()
        parent.wait()
        wait_until(lambda: not _alive(child_pid), 10, "the child to end with its trainer")
    finally:
        parent.kill()
        parent.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_trainer_json_names_the_trainer_not_the_child(tmp_path):
    """Operators and tests signal the trainer by the pid in ``trainer.json``."""
    from relax_hpc.paths import read_json

    paths = RunPaths(tmp_path).create()
    with _serving(paths) as sender:
        assert read_json(paths.rendezvous_dir / "trainer.json")["pid"] == os.getpid()
        assert sender._process.pid != os.getpid()
