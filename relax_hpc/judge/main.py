"""The judge role: a frozen generative reward model served to the rollout over HTTP.

``run_judge(cfg, paths, identity)`` is the entry point of a judge task (``judge.placement
=component``): it builds the judge (``rewards.services.build_judge_engine_scorer``: the
same scorer the rollout runs in-process with ``placement=rollout``), starts a
``JudgeServer`` on a free port of this node, publishes its address and token atomically
in ``RunPaths.judge_address_file(rank)`` (0600), and serves until it is asked to stop
(SIGTERM/SIGUSR1, or the trainer finished). Every few seconds it writes what it served to
``RunPaths.judge_status(rank)``. A restarted judge publishes a new address; rollout
clients read it again after a failed call, so the rollout needs no restart.

Its weights are frozen: it never joins the weight sync.

Must not: import the trainer or the rollout loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.config import RunConfig
from relax_hpc.judge.server import JudgeServer
from relax_hpc.paths import RunPaths, atomic_write_json
from relax_hpc.rollout.rewards.judge_address import (
    new_judge_address,
    publish_judge_address,
    withdraw_judge_address,
)
from relax_hpc.rollout.rewards.services import RewardContext, build_judge_engine_scorer
from relax_hpc.runtime import TaskIdentity
from relax_hpc.weightsync.rendezvous import default_host

log = logging.getLogger(__name__)
POLL_S = 0.5
STATUS_INTERVAL_S = 5.0


def judge_device(cfg: RunConfig, identity: TaskIdentity) -> torch.device:
    """Task k of a node serves on GPUs k*TP ... (CPU without GPUs)."""
    assert cfg.judge is not None
    if not cfg.judge.gpus_per_node:
        return torch.device("cpu")
    return torch.device("cuda", identity.local_rank * cfg.judge.engine_tensor_parallel)


def run_judge(
    cfg: RunConfig,
    paths: RunPaths,
    identity: TaskIdentity,
    host: str | None = None,
    advertised_host: str | None = None,
) -> int:
    """Serve the judge until stopped; 0. ``host`` is where to listen, ``advertised_host``
    what the address file tells clients. Both default to ``weightsync.advertise_host``
    (the address the run's other tasks reach this node by) when it is set; else the
    server listens on every interface and advertises this node's name."""
    if cfg.judge is None:
        raise ValueError("run_judge: the run has no judge section")
    configured = cfg.weightsync.advertise_host
    host = host or configured or "0.0.0.0"
    advertised_host = advertised_host or configured or None
    torch.set_num_threads(cfg.judge.torch_threads)
    stop = StopFlag(cancel_request=None).install()
    context = RewardContext(
        paths=paths, device=judge_device(cfg, identity), data=cfg.data, seed=cfg.seed
    )
    scorer = build_judge_engine_scorer(cfg.judge, context)
    address = new_judge_address("", 0, identity.attempt, identity.rank)
    server = JudgeServer(
        scorer, address.token, host, 0, max_batch=cfg.judge.batch_size, instance=address.instance
    )
    address = dataclasses.replace(address, host=advertised_host or default_host(), port=server.port)
    server.start()
    publish_judge_address(paths, address)
    log.info("judge[%d]: serving on %s:%d", identity.rank, address.host, address.port)
    try:
        serve_until_stopped(server, paths, identity.rank, stop)
    finally:
        withdraw_judge_address(paths, address)
        server.stop()
        scorer.close()
        write_judge_status(server, paths, identity.rank)
    return 0


def serve_until_stopped(server: JudgeServer, paths: RunPaths, rank: int, stop: StopFlag) -> None:
    last_status = 0.0
    while not (stop.local_request() or paths.trainer_done.exists()):
        if time.monotonic() - last_status >= STATUS_INTERVAL_S:
            write_judge_status(server, paths, rank)
            last_status = time.monotonic()
        time.sleep(POLL_S)


def write_judge_status(server: JudgeServer, paths: RunPaths, rank: int) -> None:
    counts = dataclasses.asdict(server.counts)
    uptime = time.time() - counts["started_s"]
    counts["samples_per_s"] = counts["scored"] / counts["judge_s"] if counts["judge_s"] else 0.0
    atomic_write_json(
        paths.judge_status(rank),
        {
            "time": time.time(),
            "pid": os.getpid(),  # the keeper's heartbeat check: this process's status
            "instance": server.instance,
            "uptime_s": uptime,
            **counts,
        },
    )
