"""A trainer that dies and starts again: the engine processes stay and rejoin it.

Each trainer start is a process (``weightsync_trainer_peer``) that is SIGKILLed like a
crashed trainer; the next start publishes a new ``trainer.json``. The engines (real
``WeightReceiver`` processes) must keep their process and their weights while the
trainer is gone, join the new start on their own and receive its weights, which may be
of an older version than theirs (a trainer resumed from its last checkpoint).
"""

from __future__ import annotations

import json
import os
import signal

import torch
from weightsync_peers import (
    STATUS_DIR,
    expected_fingerprint,
    read_status,
    spawn_engine,
    stop_engines,
    wait_until,
)
from weightsync_trainer_peer import spawn_trainer

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightSyncConfig

ENGINES = ["e1", "e2"]
START_S = 180  # engines and trainers import torch on 2 shared cores


def _synced(root, version: int) -> dict | None:
    path = root / STATUS_DIR / "trainer.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    found = [json.loads(line) for line in lines if line.endswith("}")]
    return next((r for r in found if r["version"] == version), None)


def _updates(root, engine_id: str) -> list[tuple[str, int, int]]:
    return [
        (r["event"], r["version"], r["fingerprint"])
        for r in read_status(root, engine_id)
        if r["event"] in ("joined", "update")
    ]


def test_engines_keep_their_processes_and_rejoin_each_new_trainer_start(tmp_path):
    paths = RunPaths(tmp_path).create()
    config = WeightSyncConfig(
        backend="gloo",
        timeout_s=5.0,
        bucket_mb=1,
        serve_dtype="bfloat16",
        fs_fallback=False,
        advertise_host="127.0.0.1",
    )
    engines = [spawn_engine(paths.root, engine_id, config) for engine_id in ENGINES]
    trainers = []
    try:
        # start 1 sends version 3; it dies; start 2 resumed from an older checkpoint sends
        # version 2; it dies too; start 3 sends version 4
        instances = []
        for version in (3, 2, 4):
            trainers.append(spawn_trainer(paths.root, version, ENGINES, config))
            synced = wait_until(lambda v=version: _synced(paths.root, v), START_S, f"v{version}")
            assert synced["members"] == ENGINES, synced
            instances.append(synced["instance"])
            os.kill(trainers[-1].pid, signal.SIGKILL)
            trainers[-1].wait()
        assert len(set(instances)) == 3
        for engine, engine_id in zip(engines, ENGINES, strict=True):
            assert engine.poll() is None, f"engine {engine_id} exited with {engine.returncode}"
            got = _updates(paths.root, engine_id)
            assert [event for event, _, _ in got] == ["joined", "update", "update", "update"]
            assert [(v, f) for _, v, f in got[1:]] == [
                (v, expected_fingerprint(v, torch.bfloat16)) for v in (3, 2, 4)
            ]
    finally:
        for trainer in trainers:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        stop_engines(paths.root, engines)
