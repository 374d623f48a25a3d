"""The torch trainer on an Omni thinker's image + audio prompts: log-probs equal the media
engine's in micro-batches budgeted by tokens and tower positions (mel frames count), a GRPO
step trains both towers, and ``trainer.freeze_audio`` keeps the audio tower out of the
gradient, the optimiser and the published weights."""

from __future__ import annotations

import pytest
import torch
from media_batches import GRPO, OMNI, TEMPERATURE, backend_of, sampled_groups

from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.errors import ConfigError
from relax_hpc.config.validate import validate_run_config
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.update import prepare_step, update_policy


@pytest.fixture(scope="module")
def policy():
    return build_media_policy(OMNI, seed=1)


@pytest.fixture(scope="module")
def batch(policy):
    model, processor = policy
    groups = sampled_groups(model, processor, 2, 3, task_name="pitch")
    return collate(groups, processor.tokenizer.pad_token_id, processor)


def test_rows_carry_image_and_audio_and_the_budget_counts_mel_frames(policy, batch):
    kwargs = batch.media_kwargs()
    assert {"pixel_values", "image_grid_thw", "input_features", "feature_attention_mask"} <= set(
        kwargs
    )
    row = batch.media.rows[0]
    frames = int(row.tensors["feature_attention_mask"].sum())
    patches = int(row.tensors["image_grid_thw"].prod(-1).sum())
    assert row.num_encoder_positions == frames + patches and frames > patches
    assert batch.encoder_positions_B[0] == row.num_encoder_positions


def test_logprobs_equal_the_engines_in_micro_batches_by_tokens_and_tower_positions(policy, batch):
    _, backend = backend_of(policy, micro_batch_tokens=batch.media.rows[0].num_encoder_positions)
    model = backend.nets.policy
    assert len(model.micro_batch_rows(batch)) == len(batch.media.rows)  # one row each
    logprobs = model.logprobs(batch, TEMPERATURE)
    mask = batch.response_mask_BT.bool()
    torch.testing.assert_close(logprobs[mask], batch.rollout_logprobs_BT[mask], atol=2e-5, rtol=0)


def moved_after_a_step(policy, batch, **trainer_fields):
    spec, backend = backend_of(policy, 10_000, GRPO, **trainer_fields)
    network = backend.nets.policy.network
    before = {n: p.detach().clone() for n, p in network.named_parameters()}
    tensors = prepare_step(spec, batch, backend.nets, TEMPERATURE)
    update_policy(spec, batch, tensors, backend.nets.policy, (1, 1, 0, 1), TEMPERATURE)
    after = dict(network.named_parameters())
    return backend, [n for n, b in before.items() if not torch.equal(b, after[n])]


def test_a_grpo_step_trains_both_towers(policy, batch):
    backend, moved = moved_after_a_step(policy, batch)
    assert set(backend.policy_weights()) == set(policy[0].state_dict())  # towers sent by name
    for prefix in ("audio_tower.", "visual.", "model.layers."):
        assert any(n.startswith(prefix) for n in moved), prefix


def test_a_frozen_audio_tower_is_not_trained_optimised_or_published(policy, batch):
    model, _ = policy
    backend, moved = moved_after_a_step(policy, batch, freeze_audio=True)
    audio = {n for n in model.state_dict() if n.startswith("audio_tower.")}
    assert audio and not set(moved) & audio and any(n.startswith("visual.") for n in moved)
    optimised = {id(p) for g in backend.nets.policy.optimizer.param_groups for p in g["params"]}
    named = dict(backend.nets.policy.network.named_parameters())
    assert not any(id(named[n]) in optimised for n in audio if n in named)
    assert set(backend.policy_weights()) == set(model.state_dict()) - audio


def test_freeze_audio_needs_a_model_with_an_audio_tower():
    cfg = compose_run_config(["+experiment=grpo_tiny", "trainer.freeze_audio=true"])
    with pytest.raises(ConfigError, match="no audio tower") as err:
        validate_run_config(cfg, check_paths=False)
    assert err.value.field == "trainer.freeze_audio"
    omni = compose_run_config(["+experiment=grpo_qwen3_omni", "trainer.freeze_audio=true"])
    validate_run_config(omni, check_paths=False)
