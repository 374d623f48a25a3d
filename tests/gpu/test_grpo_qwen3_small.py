"""grpo_qwen3_small end to end on one GPU: the Megatron trainer and an SGLang engine.

A tiny random Qwen3 (saved to a temporary folder, with the offline character tokenizer)
stands in for Qwen3-0.6B, and a few rows in DAPO-Math-17k's published layout for the dataset,
so the test needs no download; everything else is the experiment as shipped, its
``dapo_math`` reward and data config included: ``mode=sync`` on one GPU, the Megatron
backend, SGLang serving, weight sync after each step, DCP checkpoints and the Hugging Face
export at the end. Needs CUDA and the ``gpu`` extra; skipped otherwise.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import SGLANG_QWEN3, tiny_qwen3

from relax_hpc.data.schemas import SCHEMAS, dapo_math_rows, write_rows
from relax_hpc.paths import RunPaths, read_json

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
pytest.importorskip("sglang", reason="needs the gpu extra (sglang)")
pytest.importorskip("megatron.core", reason="needs the gpu extra (megatron-core)")

REPO = Path(__file__).resolve().parents[2]
ARCH = {**SGLANG_QWEN3, "max_position_embeddings": 1024}  # a DAPO prompt: ~450 characters
STEPS = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    model, tokenizer = tiny_qwen3(ARCH, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("algo", ["grpo", "ppo"])  # ppo: the Megatron critic too
def test_two_steps_with_megatron_and_sglang(tmp_path, model_dir, algo):
    run_dir = tmp_path / "run"
    data = write_rows(
        dapo_math_rows(8), tmp_path / "train.parquet", "parquet", SCHEMAS["dapo_math"]
    )
    command = [
        sys.executable,
        "-m",
        "relax_hpc.submit",
        "+experiment=grpo_qwen3_small",
        f"algo={algo}",
        "cluster=local",
        f"run_dir={run_dir}",
        f"model.path={model_dir}",
        f"data.path={data}",
        f"trainer.total_steps={STEPS}",
        "trainer.checkpoint_interval_steps=1",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=16",
        "rollout.engine_mem_fraction=0.3",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=1800)
    paths = RunPaths(run_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    done = read_json(paths.trainer_done)
    assert done["step"] == STEPS
    assert (paths.checkpoint_dir(STEPS) / "megatron").is_dir()
    assert (paths.checkpoint_dir(STEPS) / "megatron_critic").is_dir() is (algo == "ppo")
    rollout_log = paths.task_log("rollout", 0).read_text()
    assert f"policy_version {STEPS - 1}" in rollout_log  # served the trainer's weights
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(paths.export_dir)
    assert exported.config.hidden_size == ARCH["hidden_size"]
