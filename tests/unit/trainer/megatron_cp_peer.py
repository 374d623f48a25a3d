"""One rank of a 2-process CPU context-parallel run (gloo), spawned by test_megatron_cpu.py.

Each rank holds two of the four chunks of every (padded) sequence, as Megatron lays them
out; ``SdpaCoreAttention`` all-gathers keys and values over the CP group. The one
stand-in: ``torch.cuda.current_device`` answers "cpu".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron_factories import megatron_rank, right_padded_batch, tiny_qwen3

CPU = torch.device("cpu")


def hf_outputs(hf, micro):
    from relax_hpc.trainer.megatron.network import response_logprobs

    logits = hf(input_ids=micro.input_ids_BL).logits.float()
    return response_logprobs(logits, micro.input_ids_BL, micro, True)


def objective(logprobs, entropy, micro):
    mask = micro.response_mask_BT
    return (logprobs * mask).sum() + 0.1 * (entropy * mask).sum()


def run_cp_rank(rank: int, world_size: int, port: int, results) -> None:
    """Response log-probs and entropies on both ranks, and CP-averaged gradients, vs HF."""
    from relax_hpc.trainer.megatron import mapping
    from relax_hpc.trainer.megatron.backend import megatron_model_from_hf
    from relax_hpc.trainer.megatron.model import MegatronSettings

    settings = MegatronSettings(context=world_size, dtype=torch.float32, on_cpu=True)
    with megatron_rank(rank, world_size, port, settings):
        hf = tiny_qwen3(True)
        model = megatron_model_from_hf(hf, settings, CPU, micro_batch_tokens=64, optim=None)
        model.gpt_model.requires_grad_(True)
        micro = right_padded_batch([4, 6, 3], [5, 3, 6], hf.config.vocab_size)  # L = 9 -> 12
        logprobs, entropy = model.token_logprobs(micro, 1.0, with_entropy=True)
        objective(logprobs, entropy, micro).backward()
        expected_logprobs, expected_entropy = hf_outputs(hf, micro)
        objective(expected_logprobs, expected_entropy, micro).backward()
        hf_grads = mapping.hf_to_megatron(
            {n: p.grad for n, p in hf.named_parameters()}, model.shape, model.spec_name
        )
        grad_error = 0.0
        for name, param in model.gpt_model.named_parameters():
            dist.all_reduce(param.grad)  # what DDP does over data x context ranks
            grad = param.grad / world_size
            grad_error = max(grad_error, float((grad - hf_grads[name]).abs().max()))
        mask = micro.response_mask_BT > 0
        results.put(
            {
                "rank": rank,
                "cp": model._cp(),
                "local_logits": tuple(model._forward(model.network, micro.input_ids_BL).shape),
                "logprob_error": float((logprobs - expected_logprobs)[mask].abs().max()),
                "entropy_error": float((entropy - expected_entropy)[mask].abs().max()),
                "grad_error": grad_error,
            }
        )
