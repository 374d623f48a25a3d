"""Ranks of a checkpoint written under TP=2 and resumed under TP=1 (NCCL), spawned by
test_megatron_backend.py: the ``fully_reshardable`` format carries weights and Adam moments
across the layout change."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "trainer"))

from megatron_factories import megatron_rank, right_padded_batch, tiny_qwen3  # noqa: E402


def _model(rank: int, world_size: int, tensor: int, seed: int):
    from relax_hpc.trainer.megatron.backend import OptimizerSettings, megatron_model_from_hf
    from relax_hpc.trainer.megatron.model import MegatronSettings

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    settings = MegatronSettings(
        dtype=torch.float32, tensor=tensor, checkpoint_format="fully_reshardable"
    )
    hf = tiny_qwen3(False, seed=seed).to(device)
    # called once megatron_rank has set up the groups
    build = functools.partial(
        megatron_model_from_hf, hf, settings, device, 4096, OptimizerSettings(lr=1e-2)
    )
    return settings, hf.config.vocab_size, build


def _train_step(model, vocab: int) -> None:
    micros = list(model.micro_batches(right_padded_batch([4, 6], [5, 3], vocab)))

    def loss_fn(index, logprobs_BT, entropy_BT):
        mask = micros[index].response_mask_BT.to(logprobs_BT.device)
        return -(logprobs_BT * mask).sum() / mask.sum(), {}

    model.zero_grad()
    model.forward_backward(micros, 1.0, loss_fn)
    model.optimizer_step()


def _cpu(state: dict) -> dict:
    return {name: tensor.cpu() for name, tensor in state.items()}


def save_under_tp2(rank: int, world_size: int, port: int, results, checkpoint: str) -> None:
    settings, vocab, build = _model(rank, world_size, tensor=2, seed=0)
    with megatron_rank(rank, world_size, port, settings, backend="nccl"):
        model = build()
        for _ in range(2):
            _train_step(model, vocab)
        model.save_checkpoint(Path(checkpoint))
        saved = _cpu(model.hf_state_dict())
        _train_step(model, vocab)
        results.put({"rank": rank, "saved": saved, "continued": _cpu(model.hf_state_dict())})


def resume_under_tp1(rank: int, world_size: int, port: int, results, checkpoint: str) -> None:
    settings, vocab, build = _model(rank, world_size, tensor=1, seed=1)
    with megatron_rank(rank, world_size, port, settings, backend="nccl"):
        model = build()
        model.load_checkpoint(Path(checkpoint))
        loaded = _cpu(model.hf_state_dict())
        _train_step(model, vocab)
        results.put({"rank": rank, "loaded": loaded, "continued": _cpu(model.hf_state_dict())})
