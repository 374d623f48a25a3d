"""MetricsLogger: a step's scalars reach TensorBoard (one event per step) and the status file."""

from __future__ import annotations

import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import read_json


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_every_finite_scalar_of_every_step_is_read_back(tmp_path):
    logger = MetricsLogger(tmp_path / "tb", tmp_path / "status.json")
    for step in (1, 2):
        logger.log(step, {"loss/policy": 0.5 * step, "reward/mean": step, "grad/norm": math.nan})
    logger.add_scalars(7, {"eval/accuracy": 0.25})  # the evaluator's own steps
    logger.close()
    assert scalars(tmp_path / "tb") == {
        "loss/policy": [(1, 0.5), (2, 1.0)],
        "reward/mean": [(1, 1.0), (2, 2.0)],
        "eval/accuracy": [(7, 0.25)],
    }
    assert read_json(tmp_path / "status.json")["metrics"] == {"loss/policy": 1.0, "reward/mean": 2.0}
