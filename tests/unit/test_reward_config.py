"""The reward sections (rewards, judge): every name resolved and every rule checked at
submission, with one line naming the field and the fix; endpoint tokens kept out of
config.yaml."""

from __future__ import annotations

import os

import pytest

from relax_hpc import submit
from relax_hpc.config import load_run_config, validate_run_config
from relax_hpc.config.compose import compose_run_config
from relax_hpc.paths import RunPaths
from relax_hpc.resolve import resolve_names

TINY = ["+experiment=grpo_tiny", "dry_run=true"]
JUDGED = ["+experiment=grpo_tiny_judge", "dry_run=true"]
# A new entry of a map of sections is given whole on the command line (Hydra's ++).
ENDPOINT = ['++rewards.endpoints={safety: {url: "http://127.0.0.1:9/score"}}']

# (overrides, the field named, a phrase of the fix)
BAD_REWARDS = {
    "judge-without-a-judge": (TINY + ["rollout.reward=judge"], "rollout.reward", "judge=<name>"),
    "composite-without-weights": (
        TINY + ["rollout.reward=composite"],
        "rewards.weights",
        "set rewards.weights",
    ),
    "weights-without-composite": (
        TINY + ["+rewards.weights.exact_match=1"],
        "rewards.weights",
        "rollout.reward=composite",
    ),
    "unknown-part-in-weights": (
        TINY + ["rollout.reward=composite", "++rewards.weights={exact_matc: 1}"],
        "rewards.weights",
        "other reward parts: judge",
    ),
    "unknown-agreement-part": (
        JUDGED + ["rewards.agreement_with=exact"],
        "rewards.agreement_with",
        "not a built-in reward",
    ),
    "by-source-without-column": (
        TINY + ["rollout.reward=composite", "+rewards.weights_by_source.gsm8k.exact_match=1"],
        "rewards.source_key",
        "data_source",
    ),
    "credentials-in-an-endpoint-url": (
        TINY + ['++rewards.endpoints={safety: {url: "http://me:pw@127.0.0.1:9/score"}}'],
        "rewards.endpoints.safety.url",
        "token_env",
    ),
    "endpoint-url-not-http": (
        TINY + ['++rewards.endpoints={safety: {url: "ftp://127.0.0.1/x"}}'],
        "rewards.endpoints.safety.url",
        "http(s)://",
    ),
    "endpoint-named-judge": (
        TINY + ['++rewards.endpoints={judge: {url: "http://127.0.0.1:9/x"}}'],
        "rewards.reward_models/endpoints",
        "rename one",
    ),
    "endpoint-zero-timeout": (
        TINY + ENDPOINT + ["rewards.endpoints.safety.timeout_s=0"],
        "rewards.endpoints.safety.timeout_s",
        "> 0 seconds",
    ),
    "unknown-verdict": (JUDGED + ["judge.verdict=stars"], "judge.verdict", "yes_no, score"),
    "empty-score-range": (
        JUDGED + ["judge.verdict=score", "judge.score_range=[5,5]"],
        "judge.score_range",
        "low < high",
    ),
    "unknown-template": (JUDGED + ["judge.template=grade_it"], "judge.template", "{response}"),
    "sglang-judge-component-without-gpus": (
        JUDGED
        + ["judge.placement=component", "judge.backend=sglang", "judge.model.path=/m"]
        + ["judge.warm_start=none"],
        "judge.gpus_per_node",
        "judge.backend=transformers",
    ),
    "judge-component-gpus-not-a-multiple-of-tp": (
        JUDGED
        + ["judge.placement=component", "judge.gpus_per_node=3"]
        + ["judge.engine_tensor_parallel=2"],
        "judge.engine_tensor_parallel",
        "not a multiple",
    ),
    "sglang-judge-on-cpu-rollout": (
        JUDGED + ["judge.backend=sglang", "judge.model.path=/m", "judge.warm_start=none"],
        "judge.backend",
        "judge.backend=transformers",
    ),
    "verifier-for-another-task": (
        JUDGED + ["data=dapo_math", "rollout.eval_interval_steps=0"],
        "judge.warm_start",
        "judge.model.path",
    ),
    "judge-architecture": (
        JUDGED + ["judge.model.architecture=Qwen9ForCausalLM"],
        "judge.model.architecture",
        "config.json",
    ),
}


@pytest.mark.parametrize(("overrides", "field", "fix"), BAD_REWARDS.values(), ids=BAD_REWARDS)
def test_a_bad_reward_config_is_one_line_naming_the_field(overrides, field, fix, capsys):
    assert submit.run(overrides) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"relax_hpc: config error: {field}"), line
    assert fix in line


def compose(argv: list[str]):
    """The run's config of a command line (``dry_run=true`` is a submit option, not a key)."""
    return compose_run_config(submit.split_submit_options(argv)[1])


@pytest.mark.parametrize(
    "overrides",
    [
        JUDGED,
        TINY
        + [
            "judge=qwen3_tiny_verifier",
            "rollout.reward=composite",
            "++rewards.weights={exact_match: 1, judge: 0.5}",
        ],
        TINY
        + ENDPOINT
        + [
            "rollout.reward=composite",
            "rewards.source_key=source",
            "+rewards.weights_by_source.chat.safety=1",
            "+rewards.weights_by_source.math.exact_match=1",
        ],
    ],
    ids=["grpo_tiny_judge", "weighted-judge", "per-source-endpoint"],
)
def test_reward_configs_that_name_real_parts_resolve(overrides):
    cfg = compose(overrides)
    validate_run_config(cfg)
    resolve_names(cfg)


def test_a_reward_models_head_is_checked_when_the_job_starts(tmp_path):
    from reward_fixtures import save_tiny_reward_model

    folder = tmp_path / "rm"
    save_tiny_reward_model(folder, num_labels=1)
    overrides = TINY + [
        "rollout.reward=composite",
        "+rewards.weights.helpful=1",
        f"++rewards.reward_models={{helpful: {{path: '{folder}', label: 1}}}}",
    ]
    cfg = compose(overrides)
    resolve_names(cfg, check_paths=False)  # a script can be rendered without the folder
    with pytest.raises(ValueError, match=r"rewards\.reward_models\.helpful\.path: .* label 1"):
        resolve_names(cfg, check_paths=True)


def test_an_endpoint_token_given_in_the_config_moves_to_the_runs_secrets(tmp_path):
    token = "sk-lab-" + "9c1e" * 8
    run_dir = tmp_path / "run"
    overrides = [
        "+experiment=grpo_tiny",
        f"run_dir={run_dir}",
        "prepare_only=true",
        "cluster=local",
        "rollout.reward=composite",
        "++rewards.weights={exact_match: 1, safety: 0.5}",
        *ENDPOINT,
        f"rewards.endpoints.safety.token={token}",
    ]
    assert submit.run(overrides) == 0
    paths = RunPaths(run_dir)
    assert token not in paths.resolved_config.read_text()
    assert load_run_config(paths.resolved_config).rewards.endpoints["safety"].token is None
    secret = paths.endpoint_token_file("safety")
    assert secret.read_text().strip() == token
    assert os.stat(secret).st_mode & 0o777 == 0o600
    assert not any(token in p.read_text(errors="replace") for p in run_dir.rglob("*.sbatch"))
