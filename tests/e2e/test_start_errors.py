"""Your own model folder trains; what cannot start fails once, as a configuration error.

Each run is ``submit`` with ``cluster=local`` (grpo_tiny's shape, two steps): the same
supervisor and components a Slurm job runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from e2e_helpers import REPO, failure_report, submit

from relax_hpc.paths import RunPaths, read_json

TWO_SMALL_STEPS = (
    "model.warm_start=false",
    "trainer.total_steps=2",
    "trainer.checkpoint_interval_steps=2",
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=2",
    "data.eval_size=2",
)


def own_model(folder) -> tuple[str, ...]:
    return (f"model.path={folder}", "model.tokenizer=auto", *TWO_SMALL_STEPS)


@pytest.mark.slow
def test_a_model_folder_written_by_transformers5_trains_two_steps(transformers5_folder, tmp_path):
    folder, _, _ = transformers5_folder
    run_dir = tmp_path / "run"
    result = submit(run_dir, *own_model(folder), timeout_s=300)
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    assert read_json(paths.trainer_done)["step"] == 2
    assert (paths.checkpoint_dir(2) / "COMPLETE").is_file()
    assert "building it from tokenizer.json" in paths.task_log("trainer", 0).read_text()


@pytest.mark.slow
def test_a_model_folder_that_cannot_load_exits_2_once(broken_model_folder, tmp_path):
    broken = broken_model_folder
    run_dir = tmp_path / "run"
    result = submit(run_dir, *own_model(broken), "cluster.max_restarts=3", timeout_s=300)
    assert result.returncode == 2, failure_report(result, run_dir)
    assert f"config error: model.path: {broken} cannot be loaded" in result.stderr
    assert "restart" not in result.stderr  # no "restart 1 of 3", let alone "4 of 3"
    trainer_log = RunPaths(run_dir).task_log("trainer", 0).read_text()
    assert trainer_log.count("of job attempt") == 1
    assert read_json(RunPaths(run_dir).config_error)["field"] == "model.path"


def test_an_interpreter_without_the_dependencies_exits_2_once(tmp_path):
    venv = tmp_path / "bare-venv"  # a real interpreter with none of relax_hpc's dependencies
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    run_dir = tmp_path / "run"
    result = submit(
        run_dir,
        f"cluster.python={venv}/bin/python",
        *TWO_SMALL_STEPS,
        timeout_s=300,
        env={"PYTHONPATH": str(REPO)},  # relax_hpc itself is found; its dependencies are not
    )
    assert result.returncode == 2, failure_report(result, run_dir)
    assert f"config error: cluster.python: {venv}/bin/python cannot import" in result.stderr
    assert "leave cluster.python unset" in result.stderr
    assert "restart" not in result.stderr
