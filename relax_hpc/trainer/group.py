"""The trainer's own process group (data parallelism), formed through the run directory.

Rank 0 opens a ``TCPStore`` and publishes its address in ``rendezvous/trainer_group.json``
tagged with the attempt (job id + restart count), so that ranks of a requeued job never
join a store of an earlier attempt. This group is separate from the weight-sync group.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from relax_hpc.paths import RunPaths, atomic_write_json, read_json
from relax_hpc.runtime import TaskIdentity


def init_trainer_group(
    paths: RunPaths, identity: TaskIdentity, backend: str, timeout_s: float
) -> None:
    """``init_process_group`` over all trainer ranks; a no-op for a single rank."""
    if identity.world_size == 1:
        return
    address_file = paths.trainer_group_file
    timeout = timedelta(seconds=timeout_s)
    if identity.rank == 0:
        host = socket.getfqdn()
        store = dist.TCPStore(
            host, 0, identity.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        atomic_write_json(
            address_file,
            {"host": host, "port": store.port, "attempt": identity.attempt},
            mode=0o600,
        )
    else:
        address = _await_address(address_file, identity.attempt, timeout_s)
        store = dist.TCPStore(
            address["host"], address["port"], identity.world_size, is_master=False, timeout=timeout
        )
    dist.init_process_group(
        backend, store=store, rank=identity.rank, world_size=identity.world_size, timeout=timeout
    )


def leave_group_and_exit(exit_code: int) -> None:
    """End a process of a multi-rank trainer once every rank is done: barrier, destroy the
    group, flush the logs, ``os._exit``. Never returns.

    Interpreter shutdown is skipped on purpose. FSDP2 keeps the group alive after
    ``destroy_process_group`` (its DTensor sharding caches hold the device mesh), and a gloo
    group freed during interpreter exit aborted about one rank in ten after a clean run
    (SIGABRT, "terminate called without an active exception"). Callers close their own
    files first (the trainer's TensorBoard writer and weight sender are closed by then)."""
    dist.barrier()  # no rank closes its connections while a peer still needs them
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _await_address(path, attempt: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        address = read_json(path, default={})
        if address.get("attempt") == attempt:
            return address
        time.sleep(0.2)
    raise TimeoutError(
        f"trainer rank 0 did not publish {path} for attempt {attempt} within {timeout_s} s"
    )
