"""One rank of a 2-process CPU expert-parallel run (gloo), spawned by test_megatron_cpu.py.

Each rank holds 2 of the 4 experts of a tiny Qwen3-MoE and its own input, as data-parallel
ranks do. Two CPU stand-ins for megatron-core 0.16.1, the only fakes in this process:
its MoE code allocates on ``torch.cuda.current_device()`` (answered "cpu" here), and
without Transformer Engine it reads an undefined ``te_general_gemm`` (set to None, so the
torch fallback runs).
"""

from __future__ import annotations

import torch
from megatron_factories import megatron_rank, tiny_qwen3_moe

CPU = torch.device("cpu")


def rank_input(rank: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(10 + rank))


def hf_grads(hf, input_ids: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    hf.zero_grad()
    (hf(input_ids=input_ids).logits * weights).sum().backward()
    return {n: p.grad.clone() for n, p in hf.named_parameters()}


def expected_grads(hf, shape, spec_name, rank: int, weights: torch.Tensor) -> dict:
    """Megatron-named gradients rank ``rank`` must hold: its own loss for replicated tensors,
    both ranks' losses for the experts (tokens of every rank reach every expert)."""
    from relax_hpc.trainer.megatron import mapping

    own = hf_grads(hf, rank_input(rank), weights)
    other = hf_grads(hf, rank_input(1 - rank), weights)
    both = {n: own[n] + other[n] for n in own}
    own_m = mapping.hf_to_megatron(own, shape, spec_name)
    both_m = mapping.hf_to_megatron(both, shape, spec_name)
    merged = {n: both_m[n] if mapping.expert_of(n) else own_m[n] for n in own_m}
    return mapping.select_local_experts(merged, shape.num_experts, 2, rank)


def run_ep_rank(rank: int, world_size: int, port: int, results) -> None:
    """Logits, gradients, gathered HF weights and micro-batch lockstep of this rank."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None
    from relax_hpc.trainer.megatron.backend import megatron_model_from_hf
    from relax_hpc.trainer.megatron.model import MegatronSettings

    settings = MegatronSettings(expert=world_size, dtype=torch.float32, on_cpu=True)
    with megatron_rank(rank, world_size, port, settings):
        hf = tiny_qwen3_moe()
        model = megatron_model_from_hf(hf, settings, CPU, micro_batch_tokens=64, optim=None)
        model.gpt_model.requires_grad_(True)
        weights = torch.randn(128, generator=torch.Generator().manual_seed(1))
        input_ids = rank_input(rank)
        logits = model.logits(input_ids)
        (logits * weights).sum().backward()
        expected = expected_grads(hf, model.shape, model.spec_name, rank, weights)
        grad_error = max(
            float((p.grad - expected[n]).abs().max()) for n, p in model.gpt_model.named_parameters()
        )
        with torch.no_grad():
            hf_logits = hf(input_ids=input_ids).logits
        exported = model.hf_state_dict()
        results.put(
            {
                "rank": rank,
                "logit_error": float((logits - hf_logits).abs().max()),
                "grad_error": grad_error,
                "local_experts": sorted(
                    {mapping_expert(n) for n in model.gpt_model.state_dict()} - {None}
                ),
                "export_exact": exported.keys() == hf.state_dict().keys()
                and all(torch.equal(exported[n], t) for n, t in hf.state_dict().items()),
                "lockstep": model._lockstep_count(1 + 2 * rank),
            }
        )


def mapping_expert(name: str) -> int | None:
    from relax_hpc.trainer.megatron import mapping

    parts = mapping.expert_of(name)
    return None if parts is None else parts[1]
