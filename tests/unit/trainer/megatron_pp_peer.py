"""One stage of a 2-process CPU pipeline-parallel run (gloo), spawned by test_megatron_cpu.py.

Megatron's 1F1B schedule allocates on CUDA, so the two stages are driven by hand here,
exactly as the schedule does for one micro-batch: stage 0 runs the embedding and layer 0
and sends its hidden states; stage 1 takes them as its input tensor, runs layer 1, the
final norm and the output layer, and sends the gradient of its input back. Untied
embeddings: with tied ones Megatron copies the embedding to the last stage with a
``.cuda()`` call. The one stand-in: ``torch.cuda.current_device`` answers "cpu".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron_factories import megatron_rank, tiny_qwen3

CPU = torch.device("cpu")
BATCH, LENGTH = 2, 12


def expected_stage_grads(hf, shape, spec_name, input_ids, weights, stage: int) -> dict:
    from relax_hpc.trainer.megatron import mapping

    hf.zero_grad()
    (hf(input_ids=input_ids).logits * weights).sum().backward()
    grads = mapping.hf_to_megatron({n: p.grad for n, p in hf.named_parameters()}, shape, spec_name)
    return mapping.select_stage(grads, shape, 2, stage)


def run_pp_rank(rank: int, world_size: int, port: int, results) -> None:
    """This stage's logits (last) or hidden states, its gradients, and the gathered export."""
    from relax_hpc.trainer.megatron.backend import megatron_model_from_hf
    from relax_hpc.trainer.megatron.model import MegatronSettings

    settings = MegatronSettings(pipeline=world_size, dtype=torch.float32, on_cpu=True)
    with megatron_rank(rank, world_size, port, settings):
        hf = tiny_qwen3(False)
        model = megatron_model_from_hf(hf, settings, CPU, micro_batch_tokens=64, optim=None)
        model.gpt_model.requires_grad_(True)
        input_ids = torch.randint(0, 128, (BATCH, LENGTH), generator=torch.Generator())
        weights = torch.randn(128, generator=torch.Generator().manual_seed(1))
        report = {"rank": rank, "pipelined": model.pipelined}
        hidden_size = hf.config.hidden_size
        if rank == 0:
            hidden = model._forward(model.network, input_ids)  # [L, B, H]: to the next stage
            dist.send(hidden.detach().contiguous(), 1)
            grad = torch.empty_like(hidden)
            dist.recv(grad, 1)
            hidden.backward(grad)
        else:
            received = torch.empty(LENGTH, BATCH, hidden_size)
            dist.recv(received, 0)
            received.requires_grad_(True)
            model.gpt_model.set_input_tensor(received)
            logits = model._forward(model.network, input_ids)
            with torch.no_grad():
                report["logit_error"] = float((logits - hf(input_ids=input_ids).logits).abs().max())
            (logits * weights).sum().backward()
            dist.send(received.grad.contiguous(), 0)
        expected = expected_stage_grads(hf, model.shape, model.spec_name, input_ids, weights, rank)
        params = dict(model.gpt_model.named_parameters())
        report["param_names_match"] = sorted(params) == sorted(expected)
        report["grad_error"] = max(
            float((params[n].grad - expected[n]).abs().max()) for n in params
        )
        exported = model.hf_state_dict()
        report["export_exact"] = exported.keys() == hf.state_dict().keys() and all(
            torch.equal(exported[n], t) for n, t in hf.state_dict().items()
        )
        results.put(report)
