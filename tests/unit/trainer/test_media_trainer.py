"""The torch trainer on image prompts: spool samples that carry their group's media become a
batch whose rows share the group's media inputs; the torch backend's log-probs equal the
media engine's, a GRPO step trains the vision tower, micro-batches by tokens + vision
patches do not change the loss, reference and critic read the images too, and FSDP2
finds the decoder layers of every model family."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from media_batches import TEMPERATURE, VL, backend_of, sampled_groups

from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import ModelConfig
from relax_hpc.config.validate import validate_run_config
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.models.multimodal import build_tiny_media_model
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.torch_backend import ValueHead, decoder_layers
from relax_hpc.trainer.update import prepare_step, update_critic, update_policy

GROUPS, PER_GROUP = 2, 4
PPO_KL = AlgoConfig(name="ppo", kl_loss_coef=0.01)  # a critic and a reference


@pytest.fixture(scope="module")
def policy():
    return build_media_policy(VL, seed=1)


@pytest.fixture(scope="module")
def groups(policy):
    return sampled_groups(*policy, GROUPS, PER_GROUP)


def test_rows_of_a_group_share_the_media_inputs_rebuilt_from_its_payload(policy, groups):
    _, processor = policy
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    rows = batch.media.rows
    assert all(rows[i] is rows[0] for i in range(PER_GROUP))
    assert rows[PER_GROUP] is not rows[0]
    assert rows[0].equals(processor.model_inputs(groups[0][0].media))
    assert batch.media_kwargs()["image_grid_thw"].shape == (GROUPS * PER_GROUP, 3)
    picked = batch.select([1, PER_GROUP + 2])
    assert picked.media.rows == [rows[1], rows[PER_GROUP + 2]]
    assert picked.media_kwargs()["pixel_values"].shape[0] == 2 * rows[0].num_encoder_positions
    # the micro-batch budget counts the vision patches besides the language tokens
    assert batch.encoder_positions_B == [rows[0].num_encoder_positions] * len(rows)


def test_collate_refuses_media_it_cannot_carry(policy, groups):
    _, processor = policy
    pad = processor.tokenizer.pad_token_id
    with pytest.raises(ValueError, match="set model.modality"):
        collate(groups, pad)  # a text trainer
    # a sample whose media do not fill its tokens (one image too many)
    stale = [[*groups[0][:-1], copy.copy(groups[0][-1])]]
    media = stale[0][-1].media
    stale[0][-1].media = dataclasses.replace(media, images=media.images * 2)
    with pytest.raises(ValueError, match=r"sample .*: the prompt holds \d+ media tokens"):
        collate(stale, pad, processor)
    text_only = [[copy.copy(s) for s in group] for group in groups]
    for group in text_only:
        for sample in group:
            sample.media = None
    assert collate(text_only, pad, processor).media is None


def test_logprobs_equal_the_engines_in_micro_batches_by_tokens_and_patches(policy, groups):
    _, processor = policy
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    _, backend = backend_of(policy, micro_batch_tokens=150)
    model = backend.nets.policy
    assert len(model.micro_batch_rows(batch)) > 2  # 16 patches per row push rows apart
    logprobs = model.logprobs(batch, TEMPERATURE)
    mask = batch.response_mask_BT.bool()
    torch.testing.assert_close(logprobs[mask], batch.rollout_logprobs_BT[mask], atol=2e-5, rtol=0)


def test_a_grpo_step_trains_the_vision_tower(policy, groups):
    _, processor = policy
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    spec, backend = backend_of(policy, micro_batch_tokens=300)
    nets = backend.nets
    tower = {n: p.detach().clone() for n, p in nets.policy.network.named_parameters()}
    tensors = prepare_step(spec, batch, nets, TEMPERATURE)
    metrics = update_policy(spec, batch, tensors, nets.policy, (1, 1, 0, 1), TEMPERATURE)
    assert all(math.isfinite(v) for v in metrics.values()) and metrics["grad_norm"] > 0
    after = dict(nets.policy.network.named_parameters())
    moved = [n for n, before in tower.items() if not torch.equal(before, after[n])]
    assert any(n.startswith("model.visual.") for n in moved), moved
    assert any(n.startswith("model.language_model.") for n in moved)


def test_micro_batches_give_the_loss_and_gradients_of_one_batch(policy, groups):
    _, processor = policy
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    results = []
    for budget in (10**6, 150):
        spec, backend = backend_of(policy, micro_batch_tokens=budget)
        model = backend.nets.policy
        assert (len(model.micro_batch_rows(batch)) > 1) == (budget == 150)
        grads = spy_on_gradients(model)
        tensors = prepare_step(spec, batch, backend.nets, TEMPERATURE)
        metrics = update_policy(spec, batch, tensors, model, (1, 1, 0, 1), TEMPERATURE)
        results.append((metrics, grads))
    (one, grads_one), (micro, grads_micro) = results
    assert micro["loss/actor"] == pytest.approx(one["loss/actor"], rel=1e-5, abs=1e-7)
    assert grads_one.keys() == grads_micro.keys()
    assert any(n.startswith("model.visual.") for n in grads_one)
    for name, grad in grads_one.items():
        torch.testing.assert_close(grads_micro[name], grad, atol=1e-6, rtol=1e-4)


def test_recomputed_activations_give_the_same_loss_and_gradients(policy, groups):
    _, processor = policy
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    results = []
    for recompute in (False, True):
        spec, backend = backend_of(policy, 300, PPO_KL, activation_checkpointing=recompute)
        model = backend.nets.policy
        assert model.network.is_gradient_checkpointing == recompute
        assert backend.nets.critic.network.body.is_gradient_checkpointing == recompute
        grads = spy_on_gradients(model)
        tensors = prepare_step(spec, batch, backend.nets, TEMPERATURE)
        metrics = update_policy(spec, batch, tensors, model, (1, 1, 0, 1), TEMPERATURE)
        results.append((metrics["loss/actor"], grads))
    (loss, grads), (recomputed_loss, recomputed_grads) = results
    assert recomputed_loss == pytest.approx(loss, rel=1e-6, abs=1e-8)
    assert any(n.startswith("model.visual.") for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed_grads[name], grad, atol=1e-7, rtol=1e-5)


def spy_on_gradients(model) -> dict[str, torch.Tensor]:
    """The gradients ``model`` holds when its optimiser steps (filled in by that step)."""
    grads: dict[str, torch.Tensor] = {}
    step = model.optimizer_step

    def recording_step():
        named = model.network.named_parameters()
        grads.update({n: p.grad.clone() for n, p in named if p.grad is not None})
        return step()

    model.optimizer_step = recording_step
    return grads


def test_reference_and_critic_read_the_images(policy, groups):
    _, processor = policy
    batch = collate(groups, processor.tokenizer.pad_token_id, processor)
    spec, backend = backend_of(policy, micro_batch_tokens=300, algo=PPO_KL)
    nets = backend.nets
    tensors = prepare_step(spec, batch, nets, TEMPERATURE)
    mask = batch.response_mask_BT.bool()
    torch.testing.assert_close(  # the reference is the initial policy, with the images
        tensors.ref_logprobs_BT[mask], batch.rollout_logprobs_BT[mask], atol=2e-5, rtol=0
    )
    critic = nets.critic
    with torch.no_grad():  # a head that reads the hidden state: values depend on the image
        critic.network.head.weight.normal_(generator=torch.Generator().manual_seed(0))
    own = critic.values(batch)
    # group 0's tokens with group 1's image (the same size, so the same image tokens)
    other = batch.select(list(range(PER_GROUP)))
    other.media = batch.media.select([PER_GROUP] * PER_GROUP)
    assert not torch.allclose(critic.values(other), own[:PER_GROUP], atol=1e-6)
    tensors = prepare_step(spec, batch, nets, TEMPERATURE)
    metrics = update_critic(spec, batch, tensors, critic, (1, 1, 0, 1))
    assert math.isfinite(metrics["loss/critic"]) and metrics["critic/grad_norm"] > 0


def test_fsdp2_finds_the_decoder_layers_of_every_family():
    from relax_hpc.models.build import build_causal_lm
    from relax_hpc.models.tokenizer import build_char_tokenizer

    arch = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
    arch |= {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16}
    text = build_causal_lm(ModelConfig(name="t", arch=arch), build_char_tokenizer())
    assert decoder_layers(text) == list(text.model.layers) and len(decoder_layers(text)) == 3
    vl, _ = build_tiny_media_model("qwen3_vl")
    assert decoder_layers(vl) == list(vl.model.language_model.layers)
    assert decoder_layers(vl.model) == list(vl.model.language_model.layers)
    assert decoder_layers(ValueHead(vl)) == list(vl.model.language_model.layers)
    omni, _ = build_tiny_media_model("qwen2_5_omni")
    assert decoder_layers(omni) == list(omni.model.layers) and len(decoder_layers(omni)) == 2
    assert decoder_layers(torch.nn.Linear(2, 2)) == []


def test_validation_refuses_megatron_for_a_vision_model_with_the_fix():
    from relax_hpc.config.compose import compose_run_config

    cfg = compose_run_config(["+experiment=grpo_qwen3_vl"])
    assert (cfg.trainer.backend, cfg.trainer.nodes, cfg.trainer.gpus_per_node) == ("torch", 1, 8)
    validate_run_config(cfg, check_paths=False)
    megatron = compose_run_config(["+experiment=grpo_qwen3_vl", "trainer=megatron_8gpu"])
    with pytest.raises(ConfigError, match="trainer.backend=torch") as err:
        validate_run_config(megatron, check_paths=False)
    assert err.value.field == "trainer.backend" and "vision" in str(err.value)


def test_the_trainer_builds_a_vision_policy_as_the_rollout_does():
    from relax_hpc.config.compose import compose_run_config
    from relax_hpc.trainer.networks import hf_networks

    cfg = compose_run_config(["+experiment=grpo_tiny", "algo.kl_loss_coef=0.01"])
    arch = {"text_config": {"num_hidden_layers": 1}}
    cfg.model = dataclasses.replace(VL, arch=arch, warm_start=False)
    networks, tokenizer = hf_networks(cfg, resolve(cfg.algo), torch.float32)
    assert type(networks.policy).__name__ == VL.architecture
    assert tokenizer is networks.processor.tokenizer
    assert networks.media_token_ids == networks.processor.media_token_ids != ()
    rollout_model, _ = build_media_policy(cfg.model, seed=cfg.seed)  # the rollout's builder
    expected = rollout_model.state_dict()
    assert len(networks.policy.model.language_model.layers) == 1
    for name, value in networks.reference.state_dict().items():
        assert torch.equal(value, expected[name])
    assert networks.reference is not networks.policy


def test_groups_read_back_from_a_shard_give_the_same_batch(policy, groups, tmp_path):
    from relax_hpc.spool.format import read_shard, write_shard_file

    _, processor = policy
    write_shard_file(tmp_path / "shard.h5", groups, "w0", 0.0)
    _, read = read_shard(tmp_path / "shard.h5")
    assert read[0][0].media is read[0][-1].media  # the spool's contract: one per group
    pad = processor.tokenizer.pad_token_id
    stored, direct = collate(read, pad, processor), collate(groups, pad, processor)
    assert all(a.equals(b) for a, b in zip(stored.media.rows, direct.media.rows, strict=True))
    assert torch.equal(stored.input_ids_BL, direct.input_ids_BL)
