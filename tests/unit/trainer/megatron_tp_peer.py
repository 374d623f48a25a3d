"""One rank of a 2-process CPU tensor-parallel run (gloo), spawned by test_megatron_cpu.py.

Megatron's TP all-gather allocates its output on ``torch.cuda.current_device()``; on a
CPU-only torch the peer answers "cpu" there, the only fake in this process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron_factories import megatron_rank, tiny_qwen3

CPU = torch.device("cpu")


def sum_partial_grads_over_tp(gpt_model: torch.nn.Module) -> None:
    """What ``finalize_model_grads`` does on GPU: q/k layernorm weights are replicated but
    each rank's gradient covers only its own heads, so the full gradient is the TP sum."""
    for name, param in gpt_model.named_parameters():
        if "q_layernorm" in name or "k_layernorm" in name:
            dist.all_reduce(param.grad)


def run_tp_rank(rank: int, world_size: int, port: int, results) -> None:
    """Logits, gradients and gathered HF weights of this rank against the HF model."""
    from relax_hpc.trainer.megatron import mapping
    from relax_hpc.trainer.megatron.backend import megatron_model_from_hf
    from relax_hpc.trainer.megatron.model import MegatronSettings

    settings = MegatronSettings(tensor=world_size, dtype=torch.float32, on_cpu=True)
    with megatron_rank(rank, world_size, port, settings):
        hf = tiny_qwen3(False)
        model = megatron_model_from_hf(hf, settings, CPU, micro_batch_tokens=64, optim=None)
        model.gpt_model.requires_grad_(True)
        input_ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
        weights = torch.randn(128, generator=torch.Generator().manual_seed(1))
        logits = model.logits(input_ids)
        hf_logits = hf(input_ids=input_ids).logits
        (logits * weights).sum().backward()
        (hf_logits * weights).sum().backward()
        sum_partial_grads_over_tp(model.gpt_model)
        hf_grads = mapping.hf_to_megatron(
            {n: p.grad for n, p in hf.named_parameters()}, model.shape, model.spec_name
        )
        grad_error = max(
            (p.grad - mapping.split_for_tp_rank(n, hf_grads[n], world_size, rank)).abs().max()
            for n, p in model.gpt_model.named_parameters()
        )
        exported = model.hf_state_dict()
        results.put(
            {
                "rank": rank,
                "logit_error": float((logits - hf_logits).abs().max()),
                "grad_error": float(grad_error),
                "export_exact": all(
                    torch.equal(exported[n], t) for n, t in hf.state_dict().items()
                ),
            }
        )
