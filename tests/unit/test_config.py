"""Composition of every shipped experiment, and the typed-config contract."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from relax_hpc.config import (
    ConfigError,
    RunConfig,
    load_run_config,
    validate_run_config,
    write_resolved_config,
)
from relax_hpc.config.compose import compose_run_config, default_config_dir
from relax_hpc.launch.examples import experiment_names

EXPERIMENTS = experiment_names()


def test_the_shipped_experiments_are_there():
    expected = {
        "grpo_tiny",
        "grpo_qwen3",
        "grpo_qwen3_colocate",
        "grpo_qwen3_vl",
        "grpo_qwen3_omni",
        "grpo_qwen3_moe",
        "grpo_qwen3_small",
    }
    assert expected <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(name):
    cfg = compose_run_config([f"+experiment={name}"])
    assert isinstance(cfg, RunConfig)
    assert cfg.name == name
    validate_run_config(cfg, check_paths=False)


@pytest.mark.parametrize(
    "algo", sorted(p.stem for p in (default_config_dir() / "algo").glob("*.yaml"))
)
def test_every_algorithm_is_reachable_from_the_command_line(algo):
    overrides = ["+experiment=grpo_tiny", f"algo={algo}"]
    if algo == "opd":
        overrides.append("model.teacher_path=teacher")
    cfg = compose_run_config(overrides)
    assert cfg.algo.name == algo
    validate_run_config(cfg, check_paths=False)


def test_grpo_qwen3_is_the_documented_recipe():
    cfg = compose_run_config(["+experiment=grpo_qwen3"])
    assert (cfg.algo.name, cfg.algo.clip_low, cfg.algo.clip_high) == ("grpo", 0.2, 0.28)
    assert cfg.algo.tis_mode == "truncate"
    assert (cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt) == (32, 8)
    assert cfg.rollout.max_new_tokens == 8192
    assert (cfg.mode, cfg.max_staleness) == ("async", 1)
    assert (cfg.trainer.gpus_per_node, cfg.trainer.parallel.tensor) == (8, 2)
    assert (cfg.rollout.gpus_per_node, cfg.rollout.backend) == (8, "sglang")


def test_overrides_reach_the_typed_config():
    cfg = compose_run_config(["+experiment=grpo_tiny", "trainer.lr=0.5", "rollout.stop=[x,y]"])
    assert cfg.trainer.lr == 0.5
    assert cfg.rollout.stop == ["x", "y"]


def test_without_an_experiment_the_name_is_required():
    with pytest.raises(ConfigError) as err:
        compose_run_config([])
    assert err.value.field == "name"


def test_resolved_config_round_trips(tmp_path: Path):
    cfg = compose_run_config(["+experiment=grpo_qwen3", "seed=7"])
    path = write_resolved_config(cfg, tmp_path / "config.yaml")
    loaded = load_run_config(path)
    assert loaded == cfg
    assert "oc.env" not in path.read_text()  # interpolations are resolved once, at submit


def test_resolved_config_with_an_unknown_key_is_rejected(tmp_path: Path):
    cfg = compose_run_config(["+experiment=grpo_tiny"])
    path = write_resolved_config(cfg, tmp_path / "config.yaml")
    path.write_text(path.read_text().replace("seed: 1", "seed: 1\nsede: 2"))
    with pytest.raises(ConfigError) as err:
        load_run_config(path)
    assert "sede" in str(err.value)


def test_paths_are_checked_only_when_running(tmp_path: Path):
    cfg = compose_run_config(["+experiment=grpo_qwen3", f"model.path={tmp_path}/absent"])
    validate_run_config(cfg, check_paths=False)
    with pytest.raises(ConfigError) as err:
        validate_run_config(cfg, check_paths=True)
    assert err.value.field == "model.path"
    validate_run_config(
        replace(cfg, model=replace(cfg.model, path=str(tmp_path))), check_paths=False
    )


def test_importing_the_config_package_does_not_import_hydra():
    code = (
        "import sys, relax_hpc.config as c; c.RunConfig();"
        "assert 'hydra' not in sys.modules, sorted(m for m in sys.modules if 'hydra' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prepare_only_writes_the_run_directory_and_submits_nothing(tmp_path, capsys):
    from relax_hpc import submit
    from relax_hpc.paths import RunPaths

    run_dir = tmp_path / "run"
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    paths = RunPaths(run_dir)
    stored = load_run_config(paths.resolved_config)
    assert stored.run_dir == str(run_dir)
    assert "\nprepare_only:" not in paths.resolved_config.read_text()  # how, not what, to run
    assert paths.sbatch_script.read_text().startswith("#!/bin/bash")
    assert "sbatch" in capsys.readouterr().out
    # A second submission into the same directory resumes it with the stored config.
    assert (
        submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "seed=99", "prepare_only=true"])
        == 0
    )
    assert load_run_config(paths.resolved_config).seed == stored.seed
    assert "resuming it with its own config.yaml" in capsys.readouterr().err


def test_a_config_written_by_an_earlier_version_still_loads(tmp_path, caplog):
    """A run submitted before an upgrade and requeued after it keeps running."""
    from relax_hpc.config import load_run_config, run_config_to_yaml
    from relax_hpc.config.compose import compose_run_config

    text = run_config_to_yaml(compose_run_config(["+experiment=grpo_tiny"]))
    # What early versions wrote: placeholders of a one-turn run.
    old = text.replace("  environment: null\n", "  environment: single_turn\n", 1)
    old = old.replace("  max_turns: 4\n", "  max_turns: 1\n", 1)
    assert "single_turn" in old
    path = tmp_path / "config.yaml"
    path.write_text(old)
    loaded = load_run_config(path)
    assert loaded.rollout.max_new_tokens > 0
    assert (loaded.rollout.environment, loaded.rollout.max_turns) == (None, 1)  # one turn
    assert "rollout.environment: single_turn" in caplog.text
    path.write_text(text.replace("rollout:\n", "rollout:\n  max_turnz: 1\n", 1))
    with pytest.raises(ConfigError, match="max_turnz"):
        load_run_config(path)


def test_submit_options_in_an_earlier_config_are_dropped(tmp_path, caplog):
    """dry_run, prepare_only and relayout were RunConfig fields before they became options."""
    from relax_hpc.config import load_run_config, run_config_to_yaml
    from relax_hpc.config.compose import compose_run_config

    text = run_config_to_yaml(compose_run_config(["+experiment=grpo_tiny"]))
    path = tmp_path / "config.yaml"
    path.write_text("dry_run: false\nprepare_only: true\nrelayout: false\n" + text)
    assert load_run_config(path).name == "grpo_tiny"
    assert all(f"config: {key} (in" in caplog.text for key in ("dry_run", "relayout"))
    path.write_text("dry_runn: false\n" + text)
    with pytest.raises(ConfigError, match="dry_runn"):
        load_run_config(path)


def test_submit_options_are_taken_off_the_command_line():
    from relax_hpc.submit import SubmitOptions, split_submit_options

    options, overrides = split_submit_options(
        ["+experiment=grpo_tiny", "dry_run=true", "+relayout=True", "seed=3", "prepare_only=0"]
    )
    assert options == SubmitOptions(dry_run=True, prepare_only=False, relayout=True)
    assert overrides == ["+experiment=grpo_tiny", "seed=3"]
    with pytest.raises(ConfigError, match="dry_run: is a submit option; set it to true or false"):
        split_submit_options(["dry_run=maybe"])
    compose_run_config(overrides)  # what is left composes
    with pytest.raises(ConfigError, match="dry_run"):
        compose_run_config(["dry_run=true"])  # not a key of the run's config any more
