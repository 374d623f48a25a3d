"""The critic of the Megatron backend: a Qwen3 ``GPTModel`` body, the HF final norm and a
scalar head, the Megatron twin of ``torch_backend.ValueHead`` (same weights, same values).

The body is built without final norm and output layer (``body_only``), so it returns the
last hidden states ``[S, B, H]`` (split over TP ranks under sequence parallelism: gathered
here); the norm and the zero-initialised head are plain torch modules, replicated over
tensor-parallel ranks. Pipeline parallelism is not supported here.

It must not import megatron at module import time, or know about losses and batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from relax_hpc.trainer.megatron import mapping
from relax_hpc.trainer.megatron.model import (
    MegatronSettings,
    build_gpt_model,
    layer_spec_name,
    load_weights_checked,
    rank_shard,
)

# Megatron tensors of a causal LM the critic body does not have (HF keeps them elsewhere).
_NOT_IN_BODY = ("decoder.final_layernorm.weight", "output_layer.weight")


class ValueNetwork(torch.nn.Module):
    """Per-token values ``[B, S]``: ``head(final_norm(body(tokens)))``."""

    def __init__(self, body: torch.nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.body = body
        self.config = body.config  # what Megatron's wrappers and MegatronModel read
        self.final_norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask=None) -> Tensor:
        hidden_SBH = self.body(input_ids, position_ids, attention_mask=attention_mask)
        if self.config.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # every TP rank computes the same values; the backward keeps this rank's slice
            hidden_SBH = gather_from_sequence_parallel_region(
                hidden_SBH, tensor_parallel_output_grad=False
            )
        return self.head(self.final_norm(hidden_SBH)).squeeze(-1).transpose(0, 1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Megatron's distributed checkpoint: the body's shards, the norm and head replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.body.sharded_state_dict(f"{prefix}body.", sharded_offsets, metadata)
        own = {
            f"{part}.{name}": param
            for part in ("final_norm", "head")
            for name, param in getattr(self, part).named_parameters()
        }
        state.update(make_sharded_tensors_for_checkpoint(own, prefix, {}, sharded_offsets))
        return state


def build_value_network(
    hf_body: torch.nn.Module, settings: MegatronSettings
) -> tuple[ValueNetwork, mapping.LayerSpec]:
    """A ``ValueNetwork`` with the weights of the HF causal LM ``hf_body`` (head at zero)."""
    if settings.pipeline > 1:
        raise ValueError(
            "trainer.parallel.pipeline: the megatron critic (algo with GAE) needs pipeline=1"
        )
    config = hf_body.config
    spec_name = layer_spec_name(settings)
    network = ValueNetwork(
        build_gpt_model(config, settings, body_only=True), config.hidden_size, config.rms_norm_eps
    )
    shape = mapping.Qwen3Shape.from_hf_config(config)
    load_value_weights(network, hf_body.state_dict(), shape, spec_name)
    return network.to(settings.dtype), spec_name


def load_value_weights(
    network: ValueNetwork,
    hf_state: Mapping[str, Any],
    shape: mapping.Qwen3Shape,
    spec_name: mapping.LayerSpec,
) -> None:
    """The HF causal LM's body into ``network.body``, its final norm into ``final_norm``."""
    body = {
        n: t for n, t in rank_shard(hf_state, shape, spec_name).items() if n not in _NOT_IN_BODY
    }
    load_weights_checked(network.body, body)
    with torch.no_grad():
        network.final_norm.weight.copy_(hf_state["model.norm.weight"])
