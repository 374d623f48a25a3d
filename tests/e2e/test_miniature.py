"""Every shipped experiment runs in miniature (+preset=miniature) on CPU, as a user types it.

The miniature keeps the recipe's reward, algorithm, mode, data schema and keys, and swaps
the model for a tiny one of the same family and Megatron/SGLang for the torch trainer and the
transformers engine (relax_hpc/miniature.py). Each run goes through submit, the local
supervisor and both components to its second step and a complete checkpoint.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from e2e_helpers import REPO, failure_report, selected_params, submit_env, two_at_a_time

from relax_hpc.config import load_run_config
from relax_hpc.config.compose import compose_run_config
from relax_hpc.launch.examples import experiment_names
from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import read_shard

RUNNABLE = tuple(experiment_names())
VISION = ("grpo_qwen3_vl", "grpo_tiny_vl")
AUDIO = ("grpo_qwen3_omni", "grpo_tiny_omni")  # audio or omni models


def submit_miniature(name: str, run_dir, *overrides: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "relax_hpc.submit",
        f"+experiment={name}",
        "+preset=miniature",
        f"run_dir={run_dir}",
        *overrides,
    ]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=REPO, env=submit_env()
    )


@pytest.fixture(scope="module")
def miniature_run(request, tmp_path_factory):
    """``miniature_run(name)`` -> (run_dir, result) of that experiment's miniature. The
    selected experiments run two at a time, once per module: the omni test reads the run
    the parametrized test made (its consumed shards are kept for that) instead of starting
    grpo_qwen3_omni a second time."""

    def run(name: str) -> tuple:
        run_dir = tmp_path_factory.mktemp(name) / "run"
        return run_dir, submit_miniature(name, run_dir, "spool.keep_consumed=true")

    names = selected_params(request, "name") or ["grpo_qwen3_omni"]
    with two_at_a_time({name: functools.partial(run, name) for name in names}) as runs:
        yield lambda name: runs[name].result() if name in runs else run(name)


def test_the_lists_are_the_experiments_with_audio_and_vision_models():
    modalities = {
        name: compose_run_config([f"+experiment={name}"]).model.modality
        for name in experiment_names()
    }
    assert {name for name, modality in modalities.items() if modality in ("audio", "omni")} == set(
        AUDIO
    )
    assert {name for name, modality in modalities.items() if modality == "vision"} == set(VISION)
    assert set(VISION) | set(AUDIO) <= set(RUNNABLE)  # run below, not skipped


@pytest.mark.slow  # ~20 s on 2 free cores: three interpreters start, two steps run
@pytest.mark.parametrize("name", RUNNABLE)
def test_the_miniature_runs_to_its_second_step_and_checkpoints(name, miniature_run):
    run_dir, result = miniature_run(name)
    assert result.returncode == 0, failure_report(result, run_dir)
    assert f"MINIATURE run of {name} (+preset=miniature)" in result.stderr
    paths = RunPaths(run_dir)
    assert read_json(paths.trainer_done)["step"] == 2
    assert (paths.checkpoint_dir(2) / "COMPLETE").is_file()
    assert "MINIATURE run" in paths.task_log("trainer", 0).read_text()
    cfg = load_run_config(paths.resolved_config)
    recipe = compose_run_config([f"+experiment={name}"])
    assert cfg.miniature and (cfg.trainer.backend, cfg.rollout.backend) == ("torch", "transformers")
    assert cfg.model.architecture == recipe.model.architecture  # the same family, shrunk
    assert (cfg.rollout.reward, cfg.algo, cfg.mode) == (
        recipe.rollout.reward,
        recipe.algo,
        recipe.mode,
    )
    assert (cfg.data.schema, cfg.data.prompt_key, cfg.data.answer_key) == (
        recipe.data.schema,
        recipe.data.prompt_key,
        recipe.data.answer_key,
    )


@pytest.mark.slow
def test_the_omni_miniature_trains_on_rows_with_an_image_and_a_clip(miniature_run):
    """grpo_qwen3_omni in miniature: omni_mc rows (a PNG and a WAV each) through rollout,
    spool, trainer and weight sync; the shards the trainer consumed hold both media."""
    run_dir, result = miniature_run("grpo_qwen3_omni")
    assert result.returncode == 0, failure_report(result, run_dir)
    consumed = sorted((RunPaths(run_dir).spool_dir / "consumed").iterdir())
    samples = [s for shard in consumed for group in read_shard(shard)[1] for s in group]
    assert samples and all(len(s.media.images) == 1 and len(s.media.audio) == 1 for s in samples), [
        (len(s.media.images), len(s.media.audio)) for s in samples if s.media
    ]


def test_the_gpu_script_runs_every_miniature_before_any_gpu_test():
    script = (REPO / "scripts" / "test_gpu.sh").read_text()
    miniature = script.index('CUDA_VISIBLE_DEVICES="" python -m pytest tests/e2e/test_miniature.py')
    assert miniature < script.index("bash scripts/gpu_check.sh")
    gpu_check = (REPO / "scripts" / "gpu_check.sh").read_text()
    assert "python3 -m pytest -m gpu tests/gpu" in gpu_check
