"""The Megatron trainer end to end on CPU: ``trainer.backend=megatron`` in one process beside
the transformers engine, through the same entry point, spool, weight sync, DCP checkpoints
and Hugging Face export as a GPU run (Megatron's DDP and distributed optimizer are the
CUDA-only parts; on CPU the model trains under torch's AdamW).

Killed with SIGKILL after its first checkpoint, the run resumes from it and trains every
sample exactly once; the export loads with ``transformers``.
"""

from __future__ import annotations

import pytest
import torch
from e2e_helpers import failure_report, sigkill_trainer_then_resume, trained_and_published
from transformers import AutoModelForCausalLM

from relax_hpc.paths import RunPaths, read_json
from relax_hpc.spool import check_exactly_once

MEGATRON = [
    "trainer.backend=megatron",
    "model.warm_start=false",
    "trainer.total_steps=6",
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
    second = sigkill_trainer_then_resume(run_dir, MEGATRON, resume_overrides=[])
    assert second.returncode == 0, failure_report(second, run_dir)
    log = paths.task_log("trainer", 0).read_text()
    assert "resumed from" in log and "step 3)" in log and "step 6/6" in log
    trained, samples = trained_and_published(paths)
    assert len(trained) == 6
    published = {sample.sample_id for sample in samples}
    assert not check_exactly_once(published | {s for step in trained for s in step}, trained)

    export = read_json(paths.trainer_done)["export_dir"]
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert all(torch.isfinite(p).all() for p in model.parameters())
