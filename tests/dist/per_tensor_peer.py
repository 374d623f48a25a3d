"""A rollout engine for the per-tensor transport whose "SGLang" is a CPU stand-in.

SGLang cannot run without CUDA, so ``StandInSGLangWorker`` plays the receive side of one
SGLang tensor-parallel worker (tp_rank 0, tp size 1) the way SGLang 0.5.6's model runner
does it, written here from reading that code:

- joining: ``tcp://<master_address>:<master_port>`` rendezvous at rank
  ``rank_offset + tp_rank``, the store wrapped in ``PrefixStore(group_name)``, the backend
  built with torch's ``_new_process_group_helper`` (after a default group exists, as in
  SGLang's scheduler), the group registered with an identity rank map;
- receiving: for each (name, dtype, shape) in order, ``torch.empty(shape, dtype)`` and
  ``torch.distributed.broadcast(src=0, async_op=True)``, then wait for all, then load.

It differs from SGLang in what the tests need: its group timeout is 60 s (SGLang uses
torch's default), and ``verify`` compares what it received with the trainer's checksums
(SGLang cannot). Run as a script it joins the run directory's trainer through a
``PerTensorReceiver`` and appends JSON lines to ``<root>/test_status/<id>.jsonl`` like
``weightsync_peers``. Modes: ``normal``; ``die_mid_broadcast`` (SIGKILL after the first
tensor of its first update arrived).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)
from weightsync_peers import fingerprint, status_path

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightSyncConfig, WeightVerificationError
from relax_hpc.weightsync.per_tensor import GroupEndpoint, PerTensorReceiver, tensor_checksum

GROUP_TIMEOUT = timedelta(seconds=60)


class StandInSGLangWorker:
    num_ranks = 1

    def __init__(self, emit, die_mid_broadcast: bool = False) -> None:
        self.emit = emit
        self.die_mid_broadcast = die_mid_broadcast
        self.groups: dict[str, object] = {}
        self.current = ""
        self.state: dict[str, torch.Tensor] = {}

    def join_group(self, endpoint: GroupEndpoint) -> None:
        rank = endpoint.rank_offset + 0  # + tp_rank
        url = f"tcp://{endpoint.master_address}:{endpoint.master_port}"
        store, rank, world_size = next(
            rendezvous(url, rank, endpoint.world_size, timeout=GROUP_TIMEOUT)
        )
        store.set_timeout(GROUP_TIMEOUT)
        store = PrefixStore(endpoint.group_name, store)
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            Backend(endpoint.backend),
            store,
            group_name=endpoint.group_name,
            backend_options=None,
            timeout=GROUP_TIMEOUT,
        )
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        self.groups[endpoint.group_name] = group
        self.current = endpoint.group_name
        self.emit(event="joined_group", group=endpoint.group_name, rank=rank, world_size=world_size)

    def receive(self, specs) -> None:
        group = self.groups[self.current]
        received, handles = [], []
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
            handles.append(dist.broadcast(tensor, src=0, group=group, async_op=True))
            received.append((spec.name, tensor))
        for index, handle in enumerate(handles):
            handle.wait()
            if self.die_mid_broadcast and index == 0:
                self.emit(event="dying")
                os.kill(os.getpid(), signal.SIGKILL)
        self.state = dict(received)
        self.emit(event="received", names=[name for name, _ in received])

    def verify(self, specs, checksums: list[int], algo: str) -> None:
        got = [tensor_checksum(self.state[spec.name], algo) for spec in specs]
        if got != checksums:
            raise WeightVerificationError("received tensors do not match the trainer's checksums")

    def leave_group(self, group_name: str) -> None:
        self.groups.pop(group_name, None)


def _init_default_group() -> None:
    """SGLang's scheduler always has a default group; one of size 1 stands in for it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _engine_main(root: Path, engine_id: str, mode: str, config: WeightSyncConfig) -> int:
    torch.set_num_threads(1)
    _init_default_group()
    out = status_path(root, engine_id)
    out.parent.mkdir(exist_ok=True)
    log = out.open("a", buffering=1)

    def emit(**record) -> None:
        log.write(json.dumps(record) + "\n")

    worker = StandInSGLangWorker(emit, die_mid_broadcast=mode == "die_mid_broadcast")
    receiver = PerTensorReceiver(RunPaths(root), engine_id, config, worker)
    receiver.join()
    emit(event="started")
    ready = receiver.ready_to_generate
    while not (out.parent / "stop").exists():
        update = receiver.poll_for_update(lambda tensors: None, wait_s=0.2)
        if update is not None:
            record = {n: t.clone() for n, t in worker.state.items()}
            emit(event="update", version=update.policy_version, fingerprint=fingerprint(record))
        if receiver.ready_to_generate != ready:
            ready = receiver.ready_to_generate
            emit(event="ready", value=ready, reason=receiver.fail_closed_reason)
    receiver.close()
    emit(event="stopped")
    return 0


def spawn_per_tensor_engine(
    root: Path, engine_id: str, config: WeightSyncConfig, mode: str
) -> subprocess.Popen:
    args = [sys.executable, __file__, str(root), engine_id, mode, json.dumps(vars(config))]
    return subprocess.Popen(args)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("engine_id")
    parser.add_argument("mode", choices=("normal", "die_mid_broadcast"))
    parser.add_argument("config_json")
    cli = parser.parse_args()
    config = WeightSyncConfig(**json.loads(cli.config_json))
    sys.exit(_engine_main(cli.root, cli.engine_id, cli.mode, config))
