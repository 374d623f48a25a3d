"""A text model's right-padded rows train without a padding mask (``TorchModel._inputs``):
no real token attends a pad after it, so the log-probs of the response tokens, and the
gradients they give, are those the masked forward gives, up to float round-off."""

from __future__ import annotations

import torch
from megatron_factories import right_padded_batch, tiny_qwen3

from relax_hpc.trainer.media_logprobs import media_token_logprobs
from relax_hpc.trainer.torch_backend import TorchModel

CPU = torch.device("cpu")


def response_logprobs(network, batch, attention_mask) -> torch.Tensor:
    logprobs_BT, _ = media_token_logprobs(
        network,
        batch.input_ids_BL,
        attention_mask,
        batch.prompt_len_B,
        batch.response_mask_BT.shape[1],
        {},
    )
    return logprobs_BT * batch.response_mask_BT  # past a row's response: not read


def test_text_rows_go_to_the_model_without_a_padding_mask():
    policy = TorchModel(tiny_qwen3(True, 0), CPU, micro_batch_tokens=64)
    batch = right_padded_batch([3, 5, 2], [4, 1, 6], policy.network.config.vocab_size)
    input_ids, attention = policy._inputs(batch)
    assert torch.equal(input_ids, batch.input_ids_BL) and attention is None


def test_unmasked_right_padded_rows_give_the_masked_log_probs_and_gradients():
    network = tiny_qwen3(True, 0)
    batch = right_padded_batch([3, 5, 2, 7], [4, 1, 6, 2], network.config.vocab_size)
    assert not bool(batch.attention_mask_BL.all())  # rows of different lengths: padding
    results = []
    for attention in (batch.attention_mask_BL, None):
        network.zero_grad()
        logprobs = response_logprobs(network, batch, attention)
        logprobs.sum().backward()
        results.append((logprobs.detach(), [p.grad.clone() for p in network.parameters()]))
    (masked, masked_grads), (unmasked, unmasked_grads) = results
    assert torch.allclose(unmasked, masked, atol=1e-6)
    for a, b in zip(unmasked_grads, masked_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_left_padded_rows_would_need_the_mask():
    """Why the rule is for right padding: a left pad sits before real tokens, which attend it
    unless the mask says otherwise."""
    network = tiny_qwen3(True, 0)
    batch = right_padded_batch([3, 5], [2, 2], network.config.vocab_size)
    left = torch.roll(batch.input_ids_BL[:1], shifts=3, dims=1)  # 3 pads, then the row
    mask = torch.roll(batch.attention_mask_BL[:1], shifts=3, dims=1)
    with torch.no_grad():
        masked = network(input_ids=left, attention_mask=mask).logits[0, -1]
        unmasked = network(input_ids=left).logits[0, -1]
    assert not torch.allclose(masked, unmasked, atol=1e-4)
