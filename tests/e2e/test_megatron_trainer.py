"""The Megatron trainer end to end on CPU: ``trainer.backend=megatron`` in one process beside
the transformers engine, through the same entry point, spool, weight sync, DCP checkpoints
and Hugging Face export as a GPU run (Megatron's DDP and distributed optimizer are the
CUDA-only parts; on CPU the model trains under torch's AdamW).

Killed with SIGKILL after its first checkpoint, the run resumes from its last complete one
and trains every sample exactly once; the export loads with ``transformers``.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import check_resumed_and_trained_once, sigkill_trainer_then_resume
from transformers import AutoModelForCausalLM

from relax_hpc.paths import RunPaths, read_json

STEPS = 12  # a step takes ~30 ms here: killed at step 4, the run must not finish first
MEGATRON = [
    "trainer.backend=megatron",
    "model.warm_start=false",
    f"trainer.total_steps={STEPS}",
    "trainer.checkpoint_interval_steps=3",
    "cluster.max_restarts=0",
    "observe.audit_sample_ids=true",
    "spool.keep_consumed=true",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.eval_interval_steps=0",
]


@pytest.mark.slow
def test_a_sigkilled_megatron_trainer_resumes_and_exports(tmp_path):
    run_dir, paths = tmp_path / "run", RunPaths(tmp_path / "run")
    run = sigkill_trainer_then_resume(run_dir, MEGATRON, resume_overrides=[])
    check_resumed_and_trained_once(run_dir, run, STEPS)

    export = read_json(paths.trainer_done)["export_dir"]
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
