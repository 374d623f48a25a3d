"""The weight-sync code path of tests/dist from a CUDA trainer.

With NCCL: trainer on cuda:0, engines on cuda:1.. (NCCL refuses two ranks of one
communicator on the same GPU, so that needs >= 2 GPUs). With Gloo from a CUDA trainer:
the co-located path of ``mode=sync`` (buffers in host memory), on one GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dist"))

from weightsync_peers import (  # noqa: E402
    expected_fingerprint,
    make_state,
    read_status,
    spawn_engine,
    stop_engines,
    wait_until,
)

from relax_hpc.paths import RunPaths  # noqa: E402
from relax_hpc.weightsync import WeightSender, WeightSyncConfig  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="NCCL needs one GPU per rank: trainer + engine need 2 GPUs",
)


def test_gloo_from_a_cuda_trainer_stages_in_host_memory(tmp_path):
    """The co-located route: the trainer's CUDA weights reach a host-side receiver."""
    paths = RunPaths(tmp_path).create()
    config = WeightSyncConfig(
        backend="gloo", timeout_s=20.0, bucket_mb=1, advertise_host="127.0.0.1", fs_fallback=False
    )
    sender = WeightSender(paths, config, "cuda:0")
    assert sender.device == torch.device("cpu")
    sender.start()
    processes = [spawn_engine(paths.root, "e1", config)]
    try:

        def admitted() -> bool:
            sender.admit_pending()
            return "e1" in sender.admitted_engines

        wait_until(admitted, 120, "admission")
        for version in (1, 2):
            state = {name: t.cuda() for name, t in make_state(version).items()}
            assert sender.sync(state, version).members == ["e1"]
            record = wait_until(
                lambda v=version: [
                    r
                    for r in read_status(paths.root, "e1")
                    if r.get("event") == "update" and r["version"] == v
                ],
                60,
                f"e1 at v{version}",
            )
            assert record[-1]["fingerprint"] == expected_fingerprint(version, torch.bfloat16)
    finally:
        sender.close()
        stop_engines(paths.root, processes)


@two_gpus
def test_nccl_sync_of_several_versions_and_a_dead_engine(tmp_path):
    paths = RunPaths(tmp_path).create()
    config = WeightSyncConfig(
        backend="nccl", timeout_s=20.0, bucket_mb=1, advertise_host="127.0.0.1", fs_fallback=False
    )
    num_engines = min(2, torch.cuda.device_count() - 1)
    engine_ids = [f"e{i}" for i in range(1, num_engines + 1)]
    sender = WeightSender(paths, config, "cuda:0")
    sender.start()
    processes = [
        spawn_engine(paths.root, e, config, device=f"cuda:{i + 1}")
        for i, e in enumerate(engine_ids)
    ]
    try:

        def admitted() -> bool:
            sender.admit_pending()
            return set(engine_ids) <= set(sender.admitted_engines)

        wait_until(admitted, 120, "admission")
        for version in (1, 2, 3):
            state = {name: t.cuda() for name, t in make_state(version).items()}
            report = sender.sync(state, version)
            assert sorted(report.members) == engine_ids, report
            for engine_id in engine_ids:
                record = wait_until(
                    lambda e=engine_id, v=version: [
                        r
                        for r in read_status(paths.root, e)
                        if r.get("event") == "update" and r["version"] == v
                    ],
                    60,
                    f"{engine_id} at v{version}",
                )
                assert record[-1]["fingerprint"] == expected_fingerprint(version, torch.bfloat16)
        processes[-1].kill()  # a dead engine must cost at most the timeouts, never a hang
        processes[-1].wait()
        report = sender.sync({n: t.cuda() for n, t in make_state(4).items()}, 4)
        assert engine_ids[-1] in report.dropped
        assert report.seconds < 4 * config.timeout_s + 10
    finally:
        sender.close()
        stop_engines(paths.root, processes)
