"""Every name a config refers to resolves before anything is submitted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from relax_hpc import submit
from relax_hpc.config import ConfigError, load_run_config, validate_run_config
from relax_hpc.config.compose import compose_run_config
from relax_hpc.launch.examples import experiment_names
from relax_hpc.plugins import Plugin
from relax_hpc.resolve import (
    check_backend_libraries,
    check_modality,
    resolve_names,
    reward_part_fields,
)
from relax_hpc.rollout.engines.registry import ENGINES
from relax_hpc.rollout.rewards import REWARDS
from relax_hpc.rollout.rewards.registry import JUDGE, REWARD_MODEL, part_kind


@pytest.mark.parametrize("name", experiment_names())
def test_every_shipped_experiment_resolves_every_name(name):
    cfg = compose_run_config([f"+experiment={name}"])
    validate_run_config(cfg, check_paths=False)
    resolve_names(cfg, check_paths=False)
    # The shipped recipes use built-in rule rewards (no user module) and the services they
    # configure (a judge section, a reward model of their own).
    for part, field in reward_part_fields(cfg).items():
        kind = part_kind(part, cfg.rewards, cfg.judge is not None, field)
        configured = (kind == JUDGE and cfg.judge is not None) or (
            kind == REWARD_MODEL and part in cfg.rewards.reward_models
        )
        assert part in REWARDS or configured, (part, kind)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


FILES = ["data.kind=jsonl", "data.path={tmp}/rows.jsonl", "data.eval_path={tmp}/rows.jsonl"]
# id -> (overrides with {tmp} for the test's folder, the field named, a phrase of the fix)
BAD_NAMES = {
    "unknown-reward": (["rollout.reward=dapo"], "rollout.reward", "dapo_math"),
    "missing-plugin-module": (
        ["rollout.reward=lab_rewards_absent:score"],
        "rollout.reward",
        "cannot import 'lab_rewards_absent'",
    ),
    "missing-plugin-function": (
        ["rollout.reward=lab_rewards:scroe"],
        "rollout.reward",
        "no function 'scroe'",
    ),
    "missing-environment-module": (
        ["rollout.environment=lab_envs_absent:Env"],
        "rollout.environment",
        "cannot import 'lab_envs_absent'",
    ),
    "missing-environment-class": (
        ["rollout.environment=lab_envs:Missing"],
        "rollout.environment",
        "no class 'Missing'",
    ),
    "unknown-builtin-environment": (
        ["rollout.environment=calculater"],
        "rollout.environment",
        "calculator, guess_number, python_math",
    ),
    "environment-option-it-does-not-declare": (
        ["rollout.environment=calculator", "+rollout.environment_options.tool=false"],
        "rollout.environment_options",
        "its options are ['tool_enabled']",
    ),
    "misspelled-data-key-in-the-config": (["data.promt_key=q"], "data.promt_key", "spelling"),
    "data-key-absent-from-the-file": (
        [*FILES, "data.answer_key=solution"],
        "data.answer_key",
        "columns: answer, prompt",
    ),
    "key-the-schema-does-not-have": (
        ["data=dapo_math", "data.answer_key=answer", *FILES],
        "data.answer_key",
        "reward_model.ground_truth",
    ),
    "unknown-schema": (["data.schema=dapo"], "data.schema", "dapo_math"),
    "evaluation-without-held-out-data": (
        ["data.kind=jsonl", "data.path={tmp}/rows.jsonl"],
        "rollout.eval_interval_steps",
        "data.eval_path",
    ),
    "unknown-architecture": (
        ["model.architecture=Qwen3ForCasualLM"],
        "model.architecture",
        "Qwen3ForCausalLM",
    ),
    "interpreter-that-is-not-there": (
        ["cluster.python={tmp}/venv/bin/python"],
        "cluster.python",
        "leave cluster.python unset",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_NAMES))
def test_a_name_that_resolves_to_nothing_exits_2_before_anything_is_created(
    case, tmp_path, monkeypatch, capsys
):
    write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    (tmp_path / "lab_rewards.py").write_text(
        "def score(completion, answer, metadata):\n    return 1\n"
    )
    (tmp_path / "lab_envs.py").write_text("class Present:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides, field, fix = BAD_NAMES[case]
    run_dir = tmp_path / "run"
    argv = ["+experiment=grpo_tiny", "cluster=local", f"run_dir={run_dir}"]
    argv += [override.format(tmp=tmp_path) for override in overrides]
    assert submit.run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"relax_hpc: config error: {field}")
    assert fix in err[0]
    assert not run_dir.exists()  # nothing written, nothing submitted


def test_a_user_reward_is_imported_at_submission(tmp_path, monkeypatch):
    (tmp_path / "lab_rewards_ok.py").write_text("def score(c, a, m):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_run_config(["+experiment=grpo_tiny", "rollout.reward=lab_rewards_ok:score"])
    resolve_names(cfg)
    assert "lab_rewards_ok" in sys.modules


def test_a_user_environment_is_imported_and_checked_at_submission(tmp_path, monkeypatch):
    (tmp_path / "lab_env_ok.py").write_text(
        "from dataclasses import dataclass\n"
        "from relax_hpc.rollout.envs import Environment, StepResult\n"
        "class Echo(Environment):\n"
        "    @dataclass(frozen=True)\n"
        "    class Options:\n"
        "        turns: int = 2\n"
        "        def __post_init__(self):\n"
        "            if self.turns < 1:\n"
        "                raise ValueError(f'turns must be >= 1, got {self.turns}')\n"
        "    def reset(self, row, seed):\n        return None\n"
        "    def step(self, action):\n        return StepResult(done=True)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    base = ["+experiment=grpo_tiny", "rollout.environment=lab_env_ok:Echo"]
    resolve_names(compose_run_config([*base, "+rollout.environment_options.turns=3"]), True)
    assert "lab_env_ok" in sys.modules
    with pytest.raises(ConfigError) as err:  # a value its Options refuses
        resolve_names(compose_run_config([*base, "+rollout.environment_options.turns=0"]))
    assert err.value.field == "rollout.environment_options"
    assert "Echo: turns must be >= 1, got 0" in str(err.value)


def test_python_math_checks_that_programs_can_run_without_network(monkeypatch):
    from relax_hpc.resolve import resolve_environment_name
    from relax_hpc.rollout.tools import python_exec

    base = ["+experiment=grpo_tiny", "rollout.environment=python_math"]
    monkeypatch.setattr(python_exec, "probe_network_isolation", lambda: "no namespaces here")
    resolve_environment_name(compose_run_config(base), check_paths=False)  # rendering only
    with pytest.raises(ConfigError) as err:
        resolve_environment_name(compose_run_config(base), check_paths=True)
    assert err.value.field == "rollout.environment_options"
    assert "no namespaces here" in str(err.value) and "network=allow" in str(err.value)
    allowed = compose_run_config([*base, "+rollout.environment_options.network=allow"])
    resolve_environment_name(allowed, check_paths=True)  # no probe needed


def test_a_backend_whose_library_the_interpreter_lacks_is_refused(monkeypatch):
    cfg = compose_run_config(["+experiment=grpo_qwen3", f"cluster.python={sys.executable}"])
    absent = Plugin(ENGINES.plugins["sglang"].target, ("relax_hpc_no_such_library",), "gpu")
    monkeypatch.setitem(ENGINES.plugins, "sglang", absent)
    with pytest.raises(ConfigError) as err:
        check_backend_libraries(cfg)
    assert err.value.field == "rollout.backend" and ".[gpu]" in str(err.value)
    assert "sglang needs relax_hpc_no_such_library" in str(err.value)
    other = compose_run_config(["+experiment=grpo_qwen3", "cluster.python=/opt/other/python"])
    check_backend_libraries(other)  # another interpreter: nothing known here, nothing refused


def test_a_folder_whose_config_names_another_architecture_is_refused(transformers5_folder):
    folder, _, _ = transformers5_folder
    cfg = compose_run_config(
        ["+experiment=grpo_tiny", f"model.path={folder}", "model.tokenizer=auto"]
    )
    resolve_names(cfg, check_paths=True)
    moe = compose_run_config(
        ["+experiment=grpo_tiny", f"model.path={folder}", "model.architecture=Qwen3MoeForCausalLM"]
    )
    with pytest.raises(ConfigError, match="set model.architecture=Qwen3ForCausalLM"):
        resolve_names(moe, check_paths=True)


def test_vision_audio_and_omni_experiments_run():
    for name in ("grpo_qwen3_vl", "grpo_tiny_vl", "grpo_qwen3_omni", "grpo_tiny_omni"):
        cfg = compose_run_config([f"+experiment={name}"])
        resolve_names(cfg, check_paths=False)
        check_modality(cfg.model)


def test_the_submitting_interpreter_runs_the_job_unless_overridden(tmp_path):
    run_dir = tmp_path / "run"
    assert submit.run(["+experiment=grpo_tiny", f"run_dir={run_dir}", "prepare_only=true"]) == 0
    assert load_run_config(run_dir / "config.yaml").cluster.python == sys.executable
    assert f"{sys.executable} -u -m relax_hpc.component" in (run_dir / "job.sbatch").read_text()
    other = tmp_path / "other"
    argv = ["+experiment=grpo_tiny", f"run_dir={other}", "prepare_only=true"]
    assert submit.run([*argv, "cluster.python=python3"]) == 0  # looked up on PATH in the job
    assert load_run_config(other / "config.yaml").cluster.python == "python3"


def test_megatron_runs_only_the_architectures_its_mapping_covers():
    from relax_hpc.resolve import check_megatron_architecture

    check_megatron_architecture(compose_run_config(["+experiment=grpo_qwen3_moe"]))
    llama = compose_run_config(["+experiment=grpo_qwen3", "model.architecture=LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="use trainer.backend=torch"):
        check_megatron_architecture(llama)
