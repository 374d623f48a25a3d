"""The old-log-prob shortcut (``update.old_logprobs_are_current``): where its rule holds, the
update's own forward stands in for the old policy's, with the same loss and the same
weights after the step as when the old log-probs are recomputed; where it does not hold,
they are recomputed."""

from __future__ import annotations

import pytest
import torch
from megatron_factories import right_padded_batch, tiny_qwen3

from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.trainer.backend import Networks
from relax_hpc.trainer.torch_backend import TorchModel
from relax_hpc.trainer.update import old_logprobs_are_current, prepare_step, update_policy

CPU = torch.device("cpu")
TEMPERATURE = 0.7


def policy_model(seed: int = 0, **config) -> TorchModel:
    hf = tiny_qwen3(True, seed)
    for key, value in config.items():
        setattr(hf.config, key, value)
    return TorchModel(hf, CPU, micro_batch_tokens=24, lr=1e-2)


def step_batch(vocab: int):
    batch = right_padded_batch([3, 5, 2, 4], [4, 1, 6, 3], vocab)
    batch.rewards_B = torch.tensor([1.0, 0.0, 1.0, 0.0])
    return batch


def one_step(algo: str, reuse: bool, epochs: int = 1, mini_batches: int = 1):
    """(metrics, weights after the step, how often the no-gradient log-probs ran)."""
    policy = policy_model()
    calls = []
    recompute = policy.logprobs
    policy.logprobs = lambda *a: calls.append(1) or recompute(*a)
    spec = resolve(AlgoConfig(name=algo))
    batch = step_batch(policy.network.config.vocab_size)
    tensors = prepare_step(spec, batch, Networks(policy=policy), TEMPERATURE, reuse)
    metrics = update_policy(spec, batch, tensors, policy, (epochs, mini_batches, 0, 1), TEMPERATURE)
    return metrics, {k: v.clone() for k, v in policy.network.state_dict().items()}, len(calls)


@pytest.mark.parametrize("algo", ["grpo", "gspo", "cispo", "sapo"])
def test_the_shortcut_gives_the_recomputed_loss_and_weights_bit_for_bit(algo):
    recomputed, weights, calls = one_step(algo, reuse=False)
    shortcut, shortcut_weights, shortcut_calls = one_step(algo, reuse=True)
    assert (calls, shortcut_calls) == (1, 0)  # one forward less per step
    assert shortcut["loss/actor"] == recomputed["loss/actor"]
    assert shortcut["grad_norm"] == recomputed["grad_norm"]
    assert weights.keys() == shortcut_weights.keys()
    changed = [
        k for k in weights if not torch.equal(weights[k], policy_model().network.state_dict()[k])
    ]
    assert changed  # the step trained: equal weights below mean equal gradients
    assert all(torch.equal(weights[k], shortcut_weights[k]) for k in weights)


def spec_of(**algo) -> object:
    return resolve(AlgoConfig(**{"name": "grpo", **algo}))


@pytest.mark.parametrize(
    ("spec", "epochs", "mini_batches", "deterministic", "taken"),
    [
        (spec_of(), 1, 1, True, True),
        (spec_of(), 2, 1, True, False),  # the second epoch trains on moved weights
        (spec_of(), 1, 4, True, False),  # so does every mini-batch after the first
        (spec_of(), 1, 1, False, False),  # dropout: two forwards differ
        (spec_of(use_rollout_logprobs=True), 1, 1, True, False),  # the rollout's are the old
        (spec_of(name="reinforce_pp", kl_in_reward_coef=0.1), 1, 1, True, False),  # needed first
    ],
    ids=[
        "one-update",
        "two-epochs",
        "four-mini-batches",
        "dropout",
        "rollout-logprobs",
        "kl-in-reward",
    ],
)
def test_the_rule(spec, epochs, mini_batches, deterministic, taken):
    assert old_logprobs_are_current(spec, epochs, mini_batches, deterministic) is taken


def test_a_policy_with_dropout_is_not_deterministic():
    assert policy_model().forward_is_deterministic()
    assert not policy_model(attention_dropout=0.1).forward_is_deterministic()
