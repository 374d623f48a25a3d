"""Crash test of the spool: writers and a checkpointing consumer, SIGKILLed at random moments.

Three writer processes publish groups while a consumer takes batches, checkpoints its
ledger every two steps and deletes consumed shards; an observer reads every shard it can
see. A seeded supervisor kills a random writer or the consumer (after its imports) every
few hundred milliseconds and restarts it, ``NUM_KILLS`` times, then lets the run finish.
At the end: every published sample was consumed exactly once by the surviving history
(the final checkpoint's steps), a resumed consumer replayed lost steps identically, no
partial shard was ever visible, nothing was quarantined, and abandoned temp files are
cleanable. Only POSIX rename/fsync semantics are relied on (no locks).

``SPOOL_CRASH_SEED`` picks another kill schedule, ``SPOOL_CRASH_KILLS`` another count.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once, read_shard
from relax_hpc.spool.layout import TMP_SUFFIX, SpoolLayout, list_names
from relax_hpc.spool.quarantine import clean_abandoned_tmp

WORKER = Path(__file__).with_name("spool_crash_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_WRITERS = 3
NUM_GROUPS = 40  # per writer
BATCH_GROUPS = 4  # NUM_WRITERS * NUM_GROUPS is a multiple of it
SEED = int(os.environ.get("SPOOL_CRASH_SEED", "0"))
NUM_KILLS = int(os.environ.get("SPOOL_CRASH_KILLS", "40"))
DEADLINE_S = 150.0


def _load_worker():
    spec = importlib.util.spec_from_file_location("spool_crash_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Child:
    """A restartable worker process with its log and readiness marker."""

    def __init__(self, role: str, args: list[str], state_dir: Path) -> None:
        self.role = role
        self.args = args
        self.state_dir = state_dir
        self.process: subprocess.Popen | None = None
        self.env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        )

    def start(self) -> None:
        log = open(self.state_dir / f"{self.role}.log", "a")  # noqa: SIM115 (the child owns it)
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        log.close()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def up(self) -> bool:
        return (self.state_dir / "up" / f"{self.role.split('-')[0]}-{self.process.pid}").exists()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def check_not_failed(self) -> None:
        code = self.process.poll()
        if code not in (None, 0):
            log = (self.state_dir / f"{self.role}.log").read_text()[-3000:]
            pytest.fail(f"{self.role} exited with {code}:\n{log}")


def spool_children(run: RunPaths, state_dir: Path) -> list[Child]:
    """The writers and the consumer of one spool (not started)."""
    spool, state = str(run.spool_dir), str(state_dir)
    children = [
        Child(
            f"writer{i}",
            ["writer", spool, state, f"--index={i}", f"--num-groups={NUM_GROUPS}"],
            state_dir,
        )
        for i in range(NUM_WRITERS)
    ]
    consumer_args = [
        "consumer",
        spool,
        state,
        f"--num-writers={NUM_WRITERS}",
        f"--num-groups={NUM_GROUPS}",
        f"--batch-groups={BATCH_GROUPS}",
    ]
    return [*children, Child("consumer", consumer_args, state_dir)]


def _wait_for(condition, deadline: float, what: str, poll_s: float = 0.05) -> None:
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll_s)


def _kill_randomly(children: list[Child], deadline: float) -> Counter:
    rng = random.Random(SEED)
    kills: Counter = Counter()
    while sum(kills.values()) < NUM_KILLS and any(c.running() for c in children):
        time.sleep(rng.uniform(0.02, 0.3))  # the random moment of the next kill
        if time.monotonic() > deadline:
            pytest.fail(f"kill phase ran past the deadline after {dict(kills)}")
        for child in children:
            child.check_not_failed()
        victims = [c for c in children if c.running() and c.up()]
        if not victims:
            continue
        consumers = [c for c in victims if c.role == "consumer"]
        # Half the kills hit the consumer: resuming is where a ledger goes wrong.
        victim = consumers[0] if consumers and rng.random() < 0.5 else rng.choice(victims)
        victim.kill()
        victim.start()
        kills[victim.role.rstrip("0123456789")] += 1
    return kills


def _check_replays(state_dir: Path, history: list[dict]) -> int:
    """Every step any consumer incarnation finished matches the surviving step of that number."""
    surviving = {h["step"]: h["sample_ids"] for h in history}
    num_checked = 0
    for line in (state_dir / "deliveries.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the consumer was killed mid-line
        assert record["sample_ids"] == surviving[record["step"]], (
            f"step {record['step']} replayed differently"
        )
        num_checked += 1
    return num_checked


def _leftover_sample_ids(layout: SpoolLayout) -> set[str]:
    ids = set()
    for folder in (layout.ready_dir, layout.claimed_dir):
        for name in list_names(folder):
            _, groups = read_shard(folder / name)
            ids |= {s.sample_id for g in groups for s in g}
    return ids


def test_exactly_once_under_random_sigkill(tmp_path: Path) -> None:
    worker = _load_worker()
    run = RunPaths(tmp_path / "run").create()
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    children = spool_children(run, state_dir)
    observer = Child("observer", ["observer", str(run.spool_dir), str(state_dir)], state_dir)
    deadline = time.monotonic() + DEADLINE_S
    observer.start()
    for child in children:
        child.start()

    kills = _kill_randomly(children, deadline)
    _wait_for(
        lambda: not any(c.running() for c in children), deadline, "writers and consumer to finish"
    )
    for child in children:
        child.check_not_failed()
    (state_dir / "stop_observer").touch()
    _wait_for(lambda: not observer.running(), deadline, "the observer to stop")

    layout = SpoolLayout(run.spool_dir)
    final = read_json(
        state_dir / "checkpoints" / sorted(list_names(state_dir / "checkpoints", ".json"))[-1]
    )
    history = final["history"]
    published = worker.expected_sample_ids(NUM_WRITERS, NUM_GROUPS)
    assert check_exactly_once(published, [h["sample_ids"] for h in history]) == []
    num_replayed = _check_replays(state_dir, history)
    observed = read_json(state_dir / "observer.json")
    assert observed["failures"] == [], "a partial or corrupt shard was visible"
    assert observed["verified"] > 0
    assert list_names(layout.quarantine_dir, suffix="") == []
    consumed = {s for h in history for s in h["sample_ids"]}
    assert _leftover_sample_ids(layout) <= consumed, "an unconsumed sample was left behind"
    clean_abandoned_tmp(layout, max_age_s=3600.0)  # every writer is dead now
    assert list_names(layout.tmp_dir, suffix=TMP_SUFFIX) == []
    assert kills["writer"] > 0 and kills["consumer"] > 0, kills

    status = subprocess.run(
        [sys.executable, "-m", "relax_hpc.spool", str(run.root), "status"],
        capture_output=True,
        text=True,
        env=children[0].env,
        timeout=60,
        check=True,
    )
    assert "ready" in status.stdout
    counters = json.loads(final["spool"]["spool_ledger"])["counters"]
    print(
        f"kills {dict(kills)}, steps {len(history)}, replayed steps checked {num_replayed}, "
        f"duplicate groups dropped {counters.get('num_duplicate_groups', 0)}"
    )
