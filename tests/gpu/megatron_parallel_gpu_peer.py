"""One rank of a 2-GPU pipeline- or context-parallel run (NCCL), spawned by
test_megatron_backend.py: forward-only log-probs against Hugging Face, then training steps
through ``forward_backward`` (Megatron's 1F1B schedule under PP, with the metrics broadcast
to both stages)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

from megatron_factories import megatron_rank, right_padded_batch, tiny_qwen3  # noqa: E402


def hf_logprobs(hf, batch, device) -> torch.Tensor:
    from relax_hpc.trainer.megatron.network import response_logprobs

    input_ids = batch.input_ids_BL.to(device)
    with torch.no_grad():
        logits = hf(input_ids=input_ids).logits.float()
    return response_logprobs(logits, input_ids, batch, False)[0].cpu()


def run_parallel_gpu_rank(rank: int, world_size: int, port: int, results, parallel: dict) -> None:
    from relax_hpc.trainer.megatron.backend import OptimizerSettings, megatron_model_from_hf
    from relax_hpc.trainer.megatron.model import MegatronSettings

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    settings = MegatronSettings(dtype=torch.float32, **parallel)
    with megatron_rank(rank, world_size, port, settings, backend="nccl"):
        hf = tiny_qwen3(False).to(device)
        # a small token budget: several micro-batches of different shapes per schedule
        model = megatron_model_from_hf(
            hf, settings, device, micro_batch_tokens=40, optim=OptimizerSettings(lr=1e-2)
        )
        batch = right_padded_batch([4, 6, 3, 5], [5, 3, 6, 4], hf.config.vocab_size)
        logprobs = model.logprobs(batch, 1.0)
        error = float((logprobs - hf_logprobs(hf, batch, device)).abs().max())
        micros = list(model.micro_batches(batch))

        def loss_fn(index, logprobs_BT, entropy_BT):
            mask = micros[index].response_mask_BT.to(logprobs_BT.device)
            loss = -(logprobs_BT * mask).sum() / mask.sum()
            return loss, {"entropy": (entropy_BT * mask).sum().detach()}

        losses = []
        for _ in range(5):
            model.zero_grad()
            metrics = model.forward_backward(micros, 1.0, loss_fn)
            model.optimizer_step()
            losses.append(sum(float(m["loss"]) for m in metrics))
        results.put({"rank": rank, "logprob_error": error, "micros": len(micros), "losses": losses})
