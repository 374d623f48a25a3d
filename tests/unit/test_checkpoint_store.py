"""Complete-or-absent DCP checkpoints, retention, and state adapters (one process)."""

from __future__ import annotations

import warnings

import pytest
import torch

from relax_hpc.checkpoint.stateful import ModelAndOptimizer, OpaqueState, RngState
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import (
    COMPLETE_MARKER,
    CheckpointStore,
    complete_checkpoints,
    latest_checkpoint,
)
from relax_hpc.paths import RunPaths

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Counter:
    def __init__(self, records: dict[int, list[str]] | None = None) -> None:
        self.records = records or {}

    def state_dict(self):
        return {"records": dict(self.records)}

    def load_state_dict(self, state):
        self.records = state["records"]


def trained_model(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).pow(2).sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_of_model_optimizer_and_variable_shaped_state(tmp_path):
    paths = RunPaths(tmp_path).create()
    model, optimizer = trained_model(0)
    saved = Counter({3: ["shard-a", "shard-b"]})
    CheckpointStore(paths, keep=2).save(
        3, {"app": ModelAndOptimizer(model, optimizer), "counter": OpaqueState(saved)}
    )

    fresh_model, fresh_optimizer = trained_model(1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fresh_optimizer = torch.optim.AdamW(fresh_model.parameters(), lr=0.1)  # no state yet
    loaded = Counter()
    info = latest_checkpoint(paths)
    CheckpointStore(paths, keep=2).load(
        info,
        {"app": ModelAndOptimizer(fresh_model, fresh_optimizer), "counter": OpaqueState(loaded)},
    )
    assert info.step == 3 and info.facts["step"] == 3
    assert loaded.records == {3: ["shard-a", "shard-b"]}
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)
    exp_avg = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_optimizer.state_dict()["state"][0]["exp_avg"], exp_avg)


def test_a_checkpoint_without_its_marker_is_never_loaded(tmp_path):
    paths = RunPaths(tmp_path).create()
    store = CheckpointStore(paths, keep=3)
    model, _ = trained_model(0)
    store.save(1, {"model": model.state_dict()})
    store.save(2, {"model": model.state_dict()})
    (paths.checkpoint_dir(2) / COMPLETE_MARKER).unlink()  # as if the save crashed
    (paths.checkpoints_dir / "step_00000003.partial").mkdir()
    assert latest_checkpoint(paths).step == 1


def test_retention_keeps_the_newest_complete_checkpoints(tmp_path):
    paths = RunPaths(tmp_path).create()
    store = CheckpointStore(paths, keep=2)
    model, _ = trained_model(0)
    for step in (5, 10, 15, 20):
        store.save(step, {"model": model.state_dict()}, facts={"policy_version": step})
    assert [info.step for info in complete_checkpoints(paths)] == [15, 20]
    assert latest_checkpoint(paths).facts["policy_version"] == 20
    assert sorted(p.name for p in paths.checkpoints_dir.iterdir()) == [
        "step_00000015",
        "step_00000020",
    ]


def test_rng_state_round_trip():
    rng = RngState()
    state = rng.state_dict()
    first = torch.rand(3)
    rng.load_state_dict(state)
    assert torch.equal(torch.rand(3), first)


def test_stop_flag_from_signal_and_from_cancel_file(tmp_path):
    import os
    import signal

    flag = StopFlag(cancel_request=tmp_path / "cancel")
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        flag.install((signal.SIGUSR1,))
        assert not flag.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.agreed() and flag.reason == "SIGUSR1"
    finally:
        signal.signal(signal.SIGUSR1, previous)
    now = [0.0]
    other = StopFlag(cancel_request=tmp_path / "cancel", check_interval_s=0.5, clock=lambda: now[0])
    assert not other.local_request()
    (tmp_path / "cancel").write_text("")
    now[0] = 0.4
    assert not other.local_request()  # looked for at most every 0.5 s: one stat a step cost
    now[0] = 0.5
    assert other.local_request() and other.reason == "cancel requested"


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_keep"), warnings.catch_warnings():
        CheckpointStore(RunPaths(tmp_path), keep=0)
