"""Plug-ins from outside the package run for real: a throwaway engine and a throwaway trainer
backend (``plugin_fixtures.py``), named by ``module:name`` in the config, with no line added
to ``relax_hpc``, take a tiny run through submit, both components, weight sync and a
checkpoint (the recipe: docs/architecture.md, "Plug-ins")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2e_helpers import failure_report, submit
from plugin_fixtures import BACKEND_LINE, ENGINE_LINE

from relax_hpc.paths import RunPaths, read_json

HERE = Path(__file__).resolve().parent
# The tasks import the plug-ins from here, as a user's would come from cluster.setup.
PLUGIN_PATH = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
STEPS = 2


@pytest.mark.slow  # ~30 s: three interpreters start, two steps run
def test_a_throwaway_engine_and_trainer_backend_run_from_a_test_module(tmp_path):
    run_dir = tmp_path / "run"
    result = submit(
        run_dir,
        "rollout.backend=plugin_fixtures:OneByOneBuilder",
        "trainer.backend=plugin_fixtures:CountingTorchBackend",
        f"trainer.total_steps={STEPS}",
        f"trainer.checkpoint_interval_steps={STEPS}",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.eval_interval_steps=0",
        "model.warm_start=false",
        "cluster.max_restarts=0",
        timeout_s=600,
        env=PLUGIN_PATH,
    )
    assert result.returncode == 0, failure_report(result, run_dir)
    paths = RunPaths(run_dir)
    assert read_json(paths.trainer_done)["step"] == STEPS
    assert (paths.checkpoint_dir(STEPS) / "COMPLETE").is_file()
    rollout_log = paths.task_log("rollout", 0).read_text()
    trainer_log = paths.task_log("trainer", 0).read_text()
    assert ENGINE_LINE in rollout_log, rollout_log[-3000:]
    # the first weights, then those of step 1 (step 2's may go out as the run ends)
    assert f"{BACKEND_LINE} (2)" in trainer_log, trainer_log[-3000:]


def test_a_plugin_that_does_not_import_is_refused_at_submit(tmp_path):
    result = submit(
        tmp_path / "run", "rollout.backend=plugin_fixtures:NoSuchBuilder", "dry_run=true",
        env=PLUGIN_PATH, timeout_s=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert (
        "config error: rollout.backend: plugin_fixtures has no class 'NoSuchBuilder'"
        in result.stderr
    )
