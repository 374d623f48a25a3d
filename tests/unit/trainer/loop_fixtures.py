"""``LoopSettings`` of the trainer-loop tests: one pass per step, weights synced each step."""

from __future__ import annotations

from relax_hpc.trainer.loop import LoopSettings


def loop_settings(
    total_steps: int,
    prompts_per_step: int,
    checkpoint_interval_steps: int,
    *,
    pad_token_id: int = 0,
    audit_sample_ids: bool = False,
) -> LoopSettings:
    """One epoch, one mini-batch and a weight sync per step, sampled at temperature 1."""
    return LoopSettings(
        total_steps=total_steps,
        prompts_per_step=prompts_per_step,
        checkpoint_interval_steps=checkpoint_interval_steps,
        sync_interval_steps=1,
        epochs_per_step=1,
        mini_batches_per_step=1,
        temperature=1.0,
        pad_token_id=pad_token_id,
        audit_sample_ids=audit_sample_ids,
    )
