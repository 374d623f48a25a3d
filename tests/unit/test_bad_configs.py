"""Each validation rule: a bad config exits with 2 and one line that names the field."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_hpc import submit

TINY = ["+experiment=grpo_tiny", "dry_run=true"]
QWEN = ["+experiment=grpo_qwen3", "dry_run=true"]

# (overrides, the field the message must name) - one case per rule.
BAD_CONFIGS = [
    pytest.param(TINY + ["trainer.lrr=1"], "trainer.lrr", id="unknown-key"),
    pytest.param(["model.name=???"] + TINY, "model.name", id="missing-required-value"),
    pytest.param(TINY + ["name=???"], "name", id="missing-run-name"),
    pytest.param(
        QWEN + ["trainer.parallel.data=2"], "trainer.parallel.data", id="parallel-product"
    ),
    pytest.param(
        QWEN + ["trainer.parallel.tensor=3"], "trainer.parallel.tensor", id="tp-divides-gpus"
    ),
    pytest.param(TINY + ["rollout.claim_lease_s=0"], "rollout.claim_lease_s", id="lease"),
    pytest.param(TINY + ["rollout.temperature=-1"], "rollout.temperature", id="temperature"),
    pytest.param(TINY + ["rollout.top_p=0"], "rollout.top_p", id="top-p"),
    pytest.param(TINY + ["rollout.top_k=0"], "rollout.top_k", id="top-k"),
    pytest.param(TINY + ["trainer.lr=-1"], "trainer.lr", id="lr"),
    pytest.param(TINY + ["trainer.lr=nan"], "trainer.lr", id="lr-nan"),
    pytest.param(TINY + ["trainer.weight_decay=-0.1"], "trainer.weight_decay", id="decay"),
    pytest.param(TINY + ["trainer.warmup_steps=-1"], "trainer.warmup_steps", id="warmup"),
    pytest.param(
        TINY + ["rollout.engine_mem_fraction=1.5"], "rollout.engine_mem_fraction", id="mem-share"
    ),
    pytest.param(TINY + ["rollout.reward_timeout_s=0"], "rollout.reward_timeout_s", id="reward-s"),
    pytest.param(TINY + ["data.max_prompt_tokens=0"], "data.max_prompt_tokens", id="prompt-len"),
    pytest.param(TINY + ["trainer.parallel.data=0"], "trainer.parallel.data", id="dp-zero"),
    pytest.param(
        TINY + ["observe.alerts.poll_s=0"], "observe.alerts.poll_s", id="alerts-poll"
    ),
    pytest.param(
        QWEN + ["rollout.engine_tensor_parallel=3"],
        "rollout.engine_tensor_parallel",
        id="rollout-tp",
    ),
    pytest.param(
        TINY
        + [
            "rollout.prompts_per_step=3",
            "rollout.n_samples_per_prompt=3",
            "trainer.mini_batches_per_step=2",
        ],
        "rollout.prompts_per_step",
        id="batch-split",
    ),
    pytest.param(
        TINY + ["rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt", id="group-of-one"
    ),
    pytest.param(TINY + ["mode=sync", "max_staleness=1"], "max_staleness", id="sync-staleness"),
    pytest.param(TINY + ["mode=async", "max_staleness=0"], "max_staleness", id="async-staleness"),
    pytest.param(
        TINY + ["algo.kl_loss_coef=0.1", "algo.kl_in_reward_coef=0.1"],
        "algo.kl_loss_coef",
        id="kl-twice",
    ),
    pytest.param(TINY + ["mode=bogus"], "mode", id="unknown-mode"),
    pytest.param(TINY + ["rollout.backend=sglang"], "rollout.backend", id="sglang-on-cpu"),
    pytest.param(
        TINY + ["trainer.backend=megatron", "trainer.processes_per_node=2"],
        "trainer.backend",
        id="megatron-on-cpu-in-two-processes",
    ),
    pytest.param(
        TINY + ["trainer.backend=megatron", "trainer.parallel.tensor=2"],
        "trainer.backend",
        id="megatron-on-cpu-with-tensor-parallelism",
    ),
    pytest.param(
        TINY + ["trainer.backend=megatron", "trainer.activation_checkpointing=true"],
        "trainer.activation_checkpointing",
        id="megatron-on-cpu-recomputing",
    ),
    pytest.param(TINY + ["trainer.seed=3"], "trainer.seed", id="key-in-wrong-group"),
    pytest.param(
        TINY + ["cluster.time_min=1", "cluster.signal_grace_s=60"],
        "cluster.signal_grace_s",
        id="grace-longer-than-limit",
    ),
    pytest.param(TINY + ["trainer.total_steps=abc"], "trainer.total_steps", id="wrong-type"),
    pytest.param(TINY + ["algo=nonexistent"], "algo", id="unknown-algorithm"),
    pytest.param(
        TINY + ["trainer.parallel.context=2"], "trainer.parallel.context", id="torch-context"
    ),
    pytest.param(
        QWEN + ["trainer.parallel.expert=3"], "trainer.parallel.expert", id="expert-divides-data"
    ),
    pytest.param(QWEN + ["model.dtype=float16"], "model.dtype", id="megatron-float16"),
    pytest.param(
        QWEN + ["algo=ppo", "trainer.parallel.pipeline=2"],
        "trainer.parallel.pipeline",
        id="megatron-critic-with-pipeline",
    ),
    pytest.param(
        TINY + ["weightsync.transport=sglang_distributed"],
        "weightsync.transport",
        id="sglang-transport-without-sglang",
    ),
    pytest.param(TINY + ["weightsync.transport=carrier_pigeon"], "weightsync", id="bad-transport"),
    pytest.param(
        [
            "+experiment=grpo_qwen3_colocate",
            "dry_run=true",
            "weightsync.transport=sglang_distributed",
        ],
        "weightsync.transport",
        id="sglang-transport-on-shared-gpus",
    ),
    pytest.param(TINY + ["weightsync.backend=nccl"], "weightsync.backend", id="nccl-buckets"),
    pytest.param(
        [
            "+experiment=grpo_qwen3",
            "dry_run=true",
            "weightsync.transport=sglang_distributed",
            "weightsync.background_send=true",
        ],
        "weightsync.background_send",
        id="background-send-without-buckets",
    ),
    pytest.param(
        TINY + ["weightsync.busy_floor_s=4000"], "weightsync.busy_floor_s", id="floor-over-busy"
    ),
    pytest.param(
        TINY + ["+rollout.environment_options.tool_enabled=false"],
        "rollout.environment_options",
        id="environment-options-without-environment",
    ),
    pytest.param(
        TINY + ["rollout.environment=calculator", "rollout.max_turns=0"],
        "rollout.max_turns",
        id="no-turns",
    ),
    pytest.param(
        TINY + ["rollout.environment=calculator", "rollout.tools.timeout_s=0"],
        "rollout.tools.timeout_s",
        id="tool-timeout",
    ),
    pytest.param(
        ["+experiment=grpo_tiny_judge", "dry_run=true", "rollout.environment=calculator"],
        "judge",
        id="judge-beside-an-environment",
    ),
    pytest.param(
        ["+experiment=grpo_tiny_judge", "dry_run=true", "judge.hang_after_s=0"],
        "judge.hang_after_s",
        id="judge-hang-bound",
    ),
    pytest.param(
        ["+experiment=grpo_tiny_judge", "dry_run=true", "judge.max_restarts=-1"],
        "judge.max_restarts",
        id="judge-restarts",
    ),
    pytest.param(
        ["+experiment=grpo_tiny_omni", "dry_run=true", "rollout.environment=brighter"],
        "rollout.environment",
        id="multi-turn-audio",
    ),
    pytest.param(
        TINY + ["data.kind=guess_number", "data.guess_range=[5,5]"],
        "data.guess_range",
        id="empty-guess-range",
    ),
]


@pytest.mark.parametrize(("overrides", "field"), BAD_CONFIGS)
def test_bad_config_exits_2_with_one_line_naming_the_field(overrides, field, capsys):
    assert submit.run(overrides) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("relax_hpc: config error: ")
    assert field in err[0]


def test_paths_that_do_not_exist_fail_when_running(tmp_path, capsys):
    argv = ["+experiment=grpo_qwen3", f"model.path={tmp_path}/nope", f"run_dir={tmp_path}/run"]
    assert submit.run(argv) == 2
    assert "model.path" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing is created for a config that fails


def test_a_real_process_prints_no_traceback():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax_hpc.submit",
            "+experiment=grpo_tiny",
            "mode=sync",
            "max_staleness=2",
            "dry_run=true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "max_staleness" in result.stderr


def test_without_an_experiment_the_embedded_default_runs(capsys):
    assert submit.run(["dry_run=true"]) == 0
    captured = capsys.readouterr()
    assert "embedded default grpo_tiny" in captured.err
    assert "job plan for 'grpo_tiny'" in captured.out
