"""Multi-turn samples in the trainer's loss: observation tokens get no gradient and no count.

A multi-turn sample's response interleaves model tokens (loss mask 1) with observation tokens
(mask 0, rollout log-probs 0 as placeholders). Checked against the real trainer path
(``collate`` -> ``TorchModel.token_logprobs`` -> ``compute_advantages`` / ``actor_loss`` with
the global counts of ``update.global_counts``) for every policy loss and aggregation mode:

- the gradient of the loss w.r.t. every logit that predicts an observation token (and every
  prompt or padding position) is exactly zero;
- the loss equals the single-turn loss over the model's own tokens (the same per-token values
  packed into a row with an all-ones mask), even with NaN in the observation positions of
  the old / rollout / reference log-probs;
- observation tokens count in no token or sequence denominator.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from relax_hpc.algo import AlgoConfig, actor_loss, compute_advantages, resolve
from relax_hpc.config.schema import ModelConfig
from relax_hpc.models.build import build_causal_lm
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.spool import Sample
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.torch_backend import TorchModel
from relax_hpc.trainer.update import global_counts

# The shipped tiny model (configs/model/qwen3_tiny.yaml), built from its config.
TINY_MODEL = ModelConfig(
    **yaml.safe_load((Path(__file__).parents[3] / "configs/model/qwen3_tiny.yaml").read_text())
)
# (model tokens, observation tokens) per turn; the last turn has no observation.
TURN_LAYOUTS = [
    [(4, 6), (3, 5), (2, 0)],
    [(5, 0)],  # a single-turn sample in the same batch
    [(2, 7), (6, 0)],
    [(3, 4), (1, 3), (2, 2), (4, 0)],
    [(6, 5), (2, 0)],
    [(1, 8), (3, 0)],
]
CONFIGS = {
    "grpo+entropy+kl": AlgoConfig(name="grpo", entropy_coef=0.01, kl_loss_coef=0.1),
    "grpo seq-mean-token-mean": AlgoConfig(name="grpo", loss_agg_mode="seq-mean-token-mean"),
    "grpo seq-mean-token-sum": AlgoConfig(name="grpo", loss_agg_mode="seq-mean-token-sum"),
    "dr_grpo": AlgoConfig(name="dr_grpo", loss_scale_factor=32.0),
    "rloo": AlgoConfig(name="rloo"),
    "reinforce_pp": AlgoConfig(name="reinforce_pp"),
    "reinforce_pp_baseline": AlgoConfig(name="reinforce_pp_baseline"),
    "gspo": AlgoConfig(name="gspo", gspo_clip_low=0.5, gspo_clip_high=0.5),
    "sapo": AlgoConfig(name="sapo"),
    "cispo": AlgoConfig(name="cispo"),
    "m2po": AlgoConfig(name="m2po"),
    "grpo+tis truncate": AlgoConfig(name="grpo", tis_mode="truncate"),
    "grpo+tis mask sequence": AlgoConfig(name="grpo", tis_mode="mask", tis_level="sequence"),
    "opd loss": AlgoConfig(name="opd", opd_coef=0.5, opd_mode="loss"),
    "ppo (gae)": AlgoConfig(name="ppo"),
}


def multi_turn_samples(seed: int) -> list[list[Sample]]:
    """Groups of two samples with interior observation tokens (placeholder log-probs 0)."""
    rng = np.random.default_rng(seed)
    samples = []
    for index, layout in enumerate(TURN_LAYOUTS):
        mask = np.concatenate([np.r_[np.ones(m), np.zeros(o)] for m, o in layout]).astype(np.uint8)
        logprobs = np.where(mask == 1, -rng.uniform(0.1, 3.0, len(mask)), 0.0)
        samples.append(
            Sample(
                sample_id=f"{index // 2}/{index % 2}",
                group_id=str(index // 2),
                data_index=index // 2,
                prompt_token_ids=rng.integers(4, 100, int(rng.integers(3, 7))).astype(np.int32),
                response_token_ids=rng.integers(4, 100, len(mask)).astype(np.int32),
                loss_mask=mask,
                rollout_logprobs=logprobs.astype(np.float32),
                reward=float(index % 2 == 0) + float(rng.uniform(0, 0.5)),  # groups differ
                policy_version=0,
                finish_reason="done",
                num_turns=len(layout),
            )
        )
    return [samples[i : i + 2] for i in range(0, len(samples), 2)]


@pytest.fixture(scope="module")
def policy() -> TorchModel:
    tokenizer = build_char_tokenizer()
    network = build_causal_lm(TINY_MODEL, tokenizer, seed=0)
    return TorchModel(network, torch.device("cpu"), micro_batch_tokens=4096, lr=0.0)


def step_inputs(spec, batch, logprobs_BT, seed: int):
    """Old / ref / teacher log-probs near the current ones, values, and advantages."""
    generator = torch.Generator().manual_seed(seed)
    mask = batch.response_mask_BT

    def near(scale: float) -> torch.Tensor:
        noise = torch.randn(logprobs_BT.shape, generator=generator) * scale
        return (logprobs_BT.detach() + noise) * mask

    old, ref, teacher = near(0.3), near(0.2), near(0.5)
    values = torch.randn(mask.shape, generator=generator) * mask
    advantages, _ = compute_advantages(
        spec,
        batch.rewards_B,
        mask,
        batch.group_index_B,
        values_BT=values,
        old_logprobs_BT=old,
        ref_logprobs_BT=ref,
        teacher_logprobs_BT=teacher,
    )
    return old, ref, teacher, advantages


def loss_of(spec, logprobs, old, ref, teacher, advantages, mask, rollout, entropy):
    tokens = int(mask.sum())
    sequences = int((mask.sum(-1) > 0).sum())
    loss, _ = actor_loss(
        spec,
        logprobs,
        old,
        advantages,
        mask,
        rollout_logprobs_BT=rollout,
        ref_logprobs_BT=ref,
        entropy_BT=entropy,
        teacher_logprobs_BT=teacher,
        global_num_tokens=tokens,
        global_num_seqs=sequences,
    )
    return loss


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_no_gradient_reaches_a_logit_that_predicts_an_observation_token(policy, name):
    spec = resolve(CONFIGS[name])
    batch = collate(multi_turn_samples(seed=0), pad_token_id=0)
    captured = {}

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured["logits"] = output

    handle = policy.network.lm_head.register_forward_hook(keep_logits)
    try:
        policy.zero_grad()
        logprobs, entropy = policy.token_logprobs(batch, temperature=1.0, with_entropy=True)
        old, ref, teacher, advantages = step_inputs(spec, batch, logprobs, seed=1)
        loss = loss_of(
            spec, logprobs, old, ref, teacher, advantages, batch.response_mask_BT,
            batch.rollout_logprobs_BT, entropy,
        )  # fmt: skip
        loss.backward()
    finally:
        handle.remove()
    grad_BLV = captured["logits"].grad
    assert torch.isfinite(loss) and grad_BLV is not None
    trained = torch.zeros(grad_BLV.shape[:2], dtype=torch.bool)
    for row in range(batch.num_samples):
        prompt_len = int(batch.prompt_len_B[row])
        for t in torch.nonzero(batch.response_mask_BT[row]).flatten().tolist():
            trained[row, prompt_len + t - 1] = True  # the logits that predict response token t
    assert int(trained.sum()) == global_counts(batch, 1)[0][0]
    assert torch.count_nonzero(grad_BLV[~trained]) == 0  # exactly zero, not just small
    assert bool((grad_BLV[trained].abs().sum(-1) > 0).float().mean() > 0.5)


def pack_model_tokens(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The model tokens of each row, left-aligned: the single-turn view of a sample."""
    width = int(mask_BT.sum(-1).max())
    packed = torch.zeros(x_BT.shape[0], width, dtype=x_BT.dtype)
    for row in range(x_BT.shape[0]):
        values = x_BT[row][mask_BT[row].bool()]
        packed[row, : len(values)] = values
    return packed


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_loss_equals_the_single_turn_loss_over_the_model_tokens(name):
    spec = resolve(CONFIGS[name])
    batch = collate(multi_turn_samples(seed=2), pad_token_id=0)
    mask = batch.response_mask_BT
    generator = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(mask.shape, generator=generator) * 3
    entropy = torch.rand(mask.shape, generator=generator)
    old, ref, teacher, advantages = step_inputs(spec, batch, logprobs, seed=4)
    rollout = batch.rollout_logprobs_BT
    observation = (mask == 0) & (torch.arange(mask.shape[1]) < batch.response_len_B[:, None])
    garbage = {k: v.masked_fill(observation, float("nan")) for k, v in
               {"old": old, "ref": ref, "teacher": teacher, "rollout": rollout}.items()}  # fmt: skip
    multi = loss_of(
        spec, logprobs, garbage["old"], garbage["ref"], garbage["teacher"], advantages, mask,
        garbage["rollout"], entropy,
    )  # fmt: skip
    packed = {k: pack_model_tokens(v, mask) for k, v in
              {"lp": logprobs, "old": old, "ref": ref, "teacher": teacher, "adv": advantages,
               "rollout": rollout, "entropy": entropy}.items()}  # fmt: skip
    single_mask = pack_model_tokens(torch.ones_like(mask), mask)
    single = loss_of(
        spec, packed["lp"], packed["old"], packed["ref"], packed["teacher"], packed["adv"],
        single_mask, packed["rollout"], packed["entropy"],
    )  # fmt: skip
    assert torch.isfinite(multi)
    torch.testing.assert_close(multi, single, rtol=1e-6, atol=1e-7)
    if spec.config.advantage_estimator != "gae":
        # Outcome estimators see the same samples: advantages agree token for token.
        repacked, _ = compute_advantages(
            spec, batch.rewards_B, single_mask, batch.group_index_B,
            old_logprobs_BT=packed["old"], ref_logprobs_BT=packed["ref"],
            teacher_logprobs_BT=packed["teacher"],
        )  # fmt: skip
        torch.testing.assert_close(packed["adv"], repacked, rtol=1e-5, atol=1e-6)


def test_gae_skips_observation_tokens():
    """GAE on a multi-turn row equals GAE on its model tokens alone (the TD chain skips)."""
    spec = resolve(AlgoConfig(name="ppo", normalize_advantages=False, gamma=0.9, lam=0.8))
    batch = collate(multi_turn_samples(seed=5), pad_token_id=0)
    mask = batch.response_mask_BT
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6))
    multi, _ = compute_advantages(spec, batch.rewards_B, mask, values_BT=values)
    single_mask = pack_model_tokens(torch.ones_like(mask), mask)
    single, _ = compute_advantages(
        spec, batch.rewards_B, single_mask, values_BT=pack_model_tokens(values, mask)
    )
    torch.testing.assert_close(pack_model_tokens(multi, mask), single)


def test_global_counts_hold_model_tokens_only():
    groups = multi_turn_samples(seed=0)
    batch = collate(groups, pad_token_id=0)
    model_tokens = sum(int(s.loss_mask.sum()) for g in groups for s in g)
    response_tokens = sum(len(s.response_token_ids) for g in groups for s in g)
    assert model_tokens < response_tokens
    assert global_counts(batch, 1) == [(model_tokens, len(TURN_LAYOUTS))]
    halves = global_counts(batch, 2)
    assert sum(tokens for tokens, _ in halves) == model_tokens
