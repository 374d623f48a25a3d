"""MetricsLogger: a step's scalars reach TensorBoard (one event per step) and the status file."""

from __future__ import annotations

import math
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from relax_hpc.observe.metrics import BackgroundStatusFile, MetricsLogger
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


def test_a_background_status_file_holds_the_last_record_once_closed(tmp_path):
    """The trainer's status file is written off its step (observe/metrics.py): whatever
    the thread skipped, the file ends with the last step's record."""
    logger = MetricsLogger(None, tmp_path / "trainer.json", status_in_background=True)
    for step in range(1, 201):
        logger.log(step, {"loss/policy": float(step)}, extra={"policy_version": step})
    logger.close()
    record = read_json(tmp_path / "trainer.json")
    assert (record["step"], record["policy_version"]) == (200, 200)
    assert record["metrics"] == {"loss/policy": 200.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer.json"]  # no temp left


def test_a_background_status_write_that_fails_raises_in_the_callers_thread(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    status = BackgroundStatusFile(blocked / "trainer.json")
    status.put({"step": 1})
    with pytest.raises(FileExistsError):  # mkdir of the status file's folder
        for _ in range(1000):  # the next put after the thread failed raises
            status.put({"step": 2})
            time.sleep(0.001)
        status.close()
    status.close()  # nothing pending, no error left: closes quietly


def test_a_background_status_file_is_rewritten_at_most_every_interval(tmp_path):
    path = tmp_path / "trainer.json"
    status = BackgroundStatusFile(path, min_interval_s=60.0)
    status.put({"step": 1})  # the first record: at once
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    status.put({"step": 2})
    status.put({"step": 3})
    time.sleep(0.2)
    assert read_json(path)["step"] == 1  # the next write waits for the interval
    status.close()  # ... except the last one, written by close at once
    assert read_json(path)["step"] == 3  # the newest; step 2 was never written
