"""Helpers for the weight-sync process tests: a rollout-engine process and test states.

Run as a script, it is one engine: it joins the run directory's trainer, polls for
updates and appends one JSON line per thing that happened to ``<root>/test_status/<id>.jsonl``
(the test process awaits those lines instead of sleeping). Modes:

- ``normal``: a plain engine.
- ``wrong_token``: presents a token that is not the run's.
- ``die_after_v1``: SIGKILLs itself after the first bucket of its second network update.
- ``die:<phase>:<version>``: SIGKILLs itself in the round that would bring ``version``,
  at ``phase``: ``ready`` (after saying it is ready, before reading the plan),
  ``formation`` (while the group forms: once its address is in the store, before its
  peers connected to it), ``transfer`` (after the first bucket), ``verify``
  (all buckets and the digest received, before checking them), ``load`` (inside its load
  callback). It writes a ``dying`` status line first.

The engine stops when ``<root>/test_status/stop`` exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import torch
from torch._C._distributed_c10d import TCPStore

from relax_hpc.paths import RunPaths
from relax_hpc.weightsync import WeightReceiver, WeightSyncConfig, WeightSyncRefused
from relax_hpc.weightsync.group import STORE_PREFIX
from relax_hpc.weightsync.protocol import serve_dtype_of
from relax_hpc.weightsync.rendezvous import read_trainer_endpoint

STATUS_DIR = "test_status"


def make_state(policy_version: int) -> dict[str, torch.Tensor]:
    """A ~2.9 MB (fp32: ~5.8 MB) state that differs per version; 3 buckets at 1 MiB (bf16)."""
    generator = torch.Generator().manual_seed(policy_version)
    return {
        "embed.weight": torch.randn(1024, 512, generator=generator),
        "layers.0.weight": torch.randn(1024, 512, generator=generator),
        "layers.0.bias": torch.randn(512, generator=generator),
        "lm_head.weight": torch.randn(700, 512, generator=generator),
        "num_updates": torch.full((3,), policy_version, dtype=torch.int64),
    }


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> int:
    """CRC-32 over the names and bytes of ``tensors`` (sorted by name)."""
    crc = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(tensor.view(-1).view(torch.uint8).numpy(), crc)
    return crc


def expected_fingerprint(policy_version: int, serve_dtype: torch.dtype | None) -> int:
    state = make_state(policy_version)
    return fingerprint({n: t.to(serve_dtype_of(t.dtype, serve_dtype)) for n, t in state.items()})


def status_path(root: Path, engine_id: str) -> Path:
    return Path(root) / STATUS_DIR / f"{engine_id}.jsonl"


def read_status(root: Path, engine_id: str) -> list[dict]:
    path = status_path(root, engine_id)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll ``condition`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def spawn_engine(
    root: Path, engine_id: str, config: WeightSyncConfig, mode: str = "normal", device: str = "cpu"
) -> subprocess.Popen:
    args = [sys.executable, __file__, str(root), engine_id, mode, json.dumps(vars(config)), device]
    return subprocess.Popen(args)


def stop_engines(root: Path, processes: list[subprocess.Popen], timeout_s: float = 30) -> None:
    (Path(root) / STATUS_DIR).mkdir(exist_ok=True)
    (Path(root) / STATUS_DIR / "stop").touch()
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class _DyingReceiver(WeightReceiver):
    def _on_bucket_received(self, bucket: int) -> None:
        if self.current_policy_version == 1 and bucket == 0:
            os.kill(os.getpid(), signal.SIGKILL)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _PhaseKilledReceiver(WeightReceiver):
    """Dies at ``phase`` of the round that would bring ``version`` (see the module doc)."""

    def __init__(self, *args, phase: str, version: int, emit, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.phase, self.version, self.emit = phase, version, emit

    def due(self, phase: str) -> bool:
        # the round before ``version``'s brought version - 1 (0: the first broadcast)
        due = self.phase == phase and (self.current_policy_version or 0) == self.version - 1
        if due:
            self.emit(event="dying", phase=phase, version=self.version)
        return due

    def _read_signed(self, key: str, timeout_s: float | None = None) -> dict:
        if key.endswith("/plan") and self.due("ready"):
            _die()
        return super()._read_signed(key, timeout_s)

    def _group_for(self, plan: dict):
        if self.due("formation"):
            rank = plan["members"].index(self._member) + 1
            address_key = f"{STORE_PREFIX}/gen/{plan['generation']}/0/{rank}"
            threading.Thread(target=self._die_once_published, args=(address_key,)).start()
        return super()._group_for(plan)

    def _die_once_published(self, address_key: str) -> None:
        """Dies as soon as Gloo published this rank's address: its peers then try to
        connect to a process that is gone (Gloo retries that for several timeouts)."""
        endpoint = read_trainer_endpoint(self.paths)
        watcher = TCPStore(endpoint.host, endpoint.port, None, False, timedelta(seconds=30))
        while not watcher.check([address_key]):
            time.sleep(0.001)
        _die()

    def _on_bucket_received(self, bucket: int) -> None:
        if bucket == 0 and self.due("transfer"):
            _die()

    def _verify(self, manifest, checksums, digest) -> None:
        if self.due("verify"):
            _die()
        super()._verify(manifest, checksums, digest)


def _make_receiver(
    paths: RunPaths, engine_id: str, mode: str, config: WeightSyncConfig, device: str, emit
) -> WeightReceiver:
    if mode.startswith("die:"):
        _, phase, version = mode.split(":")
        return _PhaseKilledReceiver(
            paths, engine_id, config, device=device, phase=phase, version=int(version), emit=emit
        )
    token = "0" * 64 if mode == "wrong_token" else None
    receiver_class = _DyingReceiver if mode == "die_after_v1" else WeightReceiver
    return receiver_class(paths, engine_id, config, device=device, token=token)


def _engine_main(
    root: Path, engine_id: str, mode: str, config: WeightSyncConfig, device: str
) -> int:
    torch.set_num_threads(1)
    paths = RunPaths(root)
    out = status_path(root, engine_id)
    out.parent.mkdir(exist_ok=True)
    log = out.open("a", buffering=1)

    def emit(**record) -> None:
        log.write(json.dumps(record) + "\n")

    state: dict[str, torch.Tensor] = {}
    receiver = _make_receiver(paths, engine_id, mode, config, device, emit)

    def load(tensors: Mapping[str, torch.Tensor]) -> None:
        if isinstance(receiver, _PhaseKilledReceiver) and receiver.due("load"):
            _die()
        state.update({name: tensor.clone() for name, tensor in tensors.items()})

    receiver.join(load)
    emit(event="joined", version=receiver.current_policy_version, fingerprint=fingerprint(state))
    ready = receiver.ready_to_generate
    while not (out.parent / "stop").exists():
        try:
            update = receiver.poll_for_update(load, wait_s=0.2)
        except WeightSyncRefused as error:
            emit(event="refused", error=str(error))
            return 3
        if update is not None:
            emit(
                event="update",
                version=update.policy_version,
                source=update.source,
                fingerprint=fingerprint(state),
            )
            if mode.startswith("busy:") and update.policy_version == 1:
                time.sleep(float(mode.split(":")[1]))  # generating: it attends no round
        if receiver.ready_to_generate != ready:
            ready = receiver.ready_to_generate
            emit(
                event="ready",
                value=ready,
                version=receiver.current_policy_version,
                reason=receiver.fail_closed_reason,
            )
    receiver.close()
    emit(event="stopped")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(message)s")
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("engine_id")
    parser.add_argument(
        "mode", help="normal | wrong_token | die_after_v1 | die:<phase>:<v> | busy:<s>"
    )
    parser.add_argument("config_json")
    parser.add_argument("device", nargs="?", default="cpu")
    cli = parser.parse_args()
    config = WeightSyncConfig(**json.loads(cli.config_json))
    sys.exit(_engine_main(cli.root, cli.engine_id, cli.mode, config, cli.device))
