"""A trainer start as a process of its own, for the tests of trainer restarts.

Run as a script: it starts a ``WeightSender`` (a new ``trainer.json``, a new instance),
waits until the named engines are admitted, sends ``make_state(version)`` as ``version``
and appends ``{"event": "synced", ...}`` to ``<root>/test_status/trainer.jsonl``; then it
waits to be killed (or for ``<root>/test_status/stop``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from weightsync_peers import STATUS_DIR, make_state, wait_until

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightSender, WeightSyncConfig

ADMISSION_S = 120  # an engine that lost its trainer looks for the next one every 0.5 s


def spawn_trainer(root: Path, version: int, engines: list[str], config: WeightSyncConfig):
    args = [sys.executable, __file__, str(root), str(version), ",".join(engines)]
    return subprocess.Popen([*args, json.dumps(vars(config))])


def _main(root: Path, version: int, engines: list[str], config: WeightSyncConfig) -> int:
    torch.set_num_threads(1)
    status = root / STATUS_DIR
    status.mkdir(exist_ok=True)
    sender = WeightSender(RunPaths(root), config, "cpu")
    endpoint = sender.start()

    def all_admitted() -> bool:
        sender.admit_pending()
        return set(engines) <= set(sender.admitted_engines)

    wait_until(all_admitted, ADMISSION_S, f"admission of {engines}")
    report = sender.sync(make_state(version), version)
    record = {"event": "synced", "version": version, "members": sorted(report.members),
              "instance": endpoint.instance}  # fmt: skip
    with (status / "trainer.jsonl").open("a") as out:
        out.write(json.dumps(record) + "\n")
    while not (status / "stop").exists():
        time.sleep(0.2)
    sender.close()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("version", type=int)
    parser.add_argument("engines")
    parser.add_argument("config_json")
    cli = parser.parse_args()
    config = WeightSyncConfig(**json.loads(cli.config_json))
    sys.exit(_main(cli.root, cli.version, cli.engines.split(","), config))
