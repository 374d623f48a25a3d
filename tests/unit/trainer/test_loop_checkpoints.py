"""When the trainer loop checkpoints: every interval, at the end, on a stop; each step once.

The real loop, store and torch backend; only the batch and the step's arithmetic are
replaced (they are tested elsewhere), so that a run of a few steps takes no time.
"""

from __future__ import annotations

import pytest
import torch
from loop_fixtures import loop_settings
from megatron_factories import tiny_qwen3

from relax_hpc import exitcodes
from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointStore, complete_checkpoints, latest_checkpoint
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.backend import HFNetworks, make_backend
from relax_hpc.trainer.loop import Trainer, sequential_broadcast


class CountingStore(CheckpointStore):
    def __init__(self, paths: RunPaths) -> None:
        super().__init__(paths, keep=10)
        self.saved_steps: list[int] = []

    def save(self, step, state, facts=None):
        self.saved_steps.append(step)
        return super().save(step, state, facts)


class StepsOnly(Trainer):
    """Every batch is empty and a step only counts; ``stop_after`` asks to stop."""

    stop_after: int | None = None

    def next_batch(self) -> list | None:
        return [] if not self.stop.agreed() else None

    def train_step(self, groups: list) -> dict[str, float]:
        self.progress.step += 1
        if self.progress.step == self.stop_after:
            self.stop.reason = "test"
        return {}


def make_trainer(tmp_path, total_steps: int, interval: int) -> StepsOnly:
    backend = make_backend(TrainerConfig(), torch.device("cpu"), torch.float32, 0, 1)
    backend.build_networks(HFNetworks(policy=tiny_qwen3(True)))
    settings = loop_settings(total_steps, 1, interval)
    return StepsOnly(
        settings=settings,
        spec=resolve(AlgoConfig(name="grpo")),
        backend=backend,
        reader=None,
        publish_weights=lambda version: {},
        store=CountingStore(RunPaths(tmp_path)),
        stop=StopFlag(),
        metrics=MetricsLogger(None, None),
        broadcast_groups=sequential_broadcast,
    )


@pytest.mark.parametrize(
    ("total_steps", "interval", "saved"), [(4, 2, [2, 4]), (5, 2, [2, 4, 5]), (3, 5, [3])]
)
def test_the_final_checkpoint_is_written_once(tmp_path, total_steps, interval, saved):
    trainer = make_trainer(tmp_path, total_steps, interval)
    assert trainer.run() == exitcodes.DONE
    assert trainer.store.saved_steps == saved
    assert [info.step for info in complete_checkpoints(RunPaths(tmp_path))] == saved


def test_a_stop_right_after_a_periodic_checkpoint_saves_nothing_more(tmp_path):
    trainer = make_trainer(tmp_path, total_steps=10, interval=2)
    trainer.stop_after = 4
    assert trainer.run() == exitcodes.STOPPED
    assert trainer.store.saved_steps == [2, 4]

    trainer = make_trainer(tmp_path / "other", total_steps=10, interval=4)
    trainer.stop_after = 3
    assert trainer.run() == exitcodes.STOPPED
    assert trainer.store.saved_steps == [3]


def test_a_resumed_finished_run_does_not_save_its_last_step_again(tmp_path):
    make_trainer(tmp_path, total_steps=4, interval=2).run()
    again = make_trainer(tmp_path, total_steps=4, interval=2)
    again.resume(latest_checkpoint(RunPaths(tmp_path)))
    assert again.progress.step == 4
    assert again.run() == exitcodes.DONE
    assert again.store.saved_steps == []
