"""Two trainer ranks (separate processes, gloo): FSDP2-sharded DCP save/load and
agreement on a stop request that only one rank received."""

from __future__ import annotations

import os
import socket
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relax_hpc.checkpoint.stateful import ModelAndOptimizer, OpaqueState
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointStore, latest_checkpoint
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.group import leave_group_and_exit

WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Progress:
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def sharded_model(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def full_weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def rank_main(rank: int, port: int, run_dir: str, phase: str, results) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    paths = RunPaths(run_dir)
    store = CheckpointStore(paths, keep=2, rank=rank, barrier=dist.barrier)
    model, optimizer = sharded_model(seed=0 if phase == "save" else 7)
    progress = Progress()
    state = {"app": ModelAndOptimizer(model, optimizer), "progress": OpaqueState(progress)}
    if phase == "save":
        torch.manual_seed(100 + rank)  # each rank trains on its own data
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        progress.step = 1
        store.save(1, state)
        flag = StopFlag()
        if rank == 1:
            flag.reason = "SIGUSR1"  # only rank 1 was signalled
        results[f"agreed{rank}"] = flag.agreed()
    else:
        store.load(latest_checkpoint(paths), state)
        results[f"step{rank}"] = progress.step
    weights = full_weights(model)
    if rank == 0:
        results[phase] = {k: v.clone() for k, v in weights.items()}
    leave_group_and_exit(0)  # as the trainer leaves: a plain exit aborted ~1 rank in 10


def run_phase(run_dir, phase: str) -> dict:
    manager = mp.Manager()
    results = manager.dict()
    port = free_port()
    context = mp.spawn(
        rank_main, args=(port, str(run_dir), phase, results), nprocs=WORLD_SIZE, join=False
    )
    deadline = time.monotonic() + 120
    while not context.join(timeout=5):  # join returns each time one process ends
        assert time.monotonic() < deadline, "ranks did not finish within 120 s"
    return dict(results)


def test_two_rank_sharded_checkpoint_round_trip_and_stop_agreement(tmp_path):
    RunPaths(tmp_path).create()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    saved = run_phase(tmp_path, "save")
    assert saved["agreed0"] is True and saved["agreed1"] is True
    loaded = run_phase(tmp_path, "load")
    assert loaded["step0"] == loaded["step1"] == 1
    assert saved["save"].keys() == loaded["load"].keys()
    for name, tensor in saved["save"].items():
        assert torch.equal(tensor, loaded["load"][name]), name
