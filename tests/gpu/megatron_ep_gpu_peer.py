"""One rank of a 2-GPU expert-parallel training run (NCCL), spawned by
test_megatron_backend.py: Megatron DDP + distributed optimizer over a tiny Qwen3-MoE whose
4 experts are split 2 per rank, each rank on its own tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

from megatron_factories import megatron_rank, tiny_qwen3_moe  # noqa: E402


def next_token_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model.logits(input_ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


def run_ep_gpu_rank(rank: int, world_size: int, port: int, results) -> None:
    from relax_hpc.trainer.megatron.backend import OptimizerSettings, megatron_model_from_hf
    from relax_hpc.trainer.megatron.model import MegatronSettings

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    settings = MegatronSettings(expert=world_size, dtype=torch.bfloat16)
    with megatron_rank(rank, world_size, port, settings, backend="nccl"):
        hf = tiny_qwen3_moe()
        model = megatron_model_from_hf(
            hf, settings, device, micro_batch_tokens=4096, optim=OptimizerSettings(lr=1e-2)
        )
        generator = torch.Generator().manual_seed(rank)
        input_ids = torch.randint(0, 128, (4, 32), generator=generator).to(device)
        losses = []
        for _ in range(5):
            model.zero_grad()
            loss = next_token_loss(model, input_ids)
            loss.backward()
            model.optimizer_step()
            losses.append(float(loss))
        exported = model.hf_state_dict()
        results.put(
            {
                "rank": rank,
                "losses": losses,
                "names_match": sorted(exported) == sorted(hf.state_dict()),
                "export_sum": float(sum(t.double().sum() for t in exported.values())),
            }
        )
