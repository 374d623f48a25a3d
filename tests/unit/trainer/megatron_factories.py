"""Tiny random Qwen3 / Qwen3-MoE models shared by the Megatron tests."""

from __future__ import annotations

import socket

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

TINY_QWEN3 = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "max_position_embeddings": 64,
}


def tiny_qwen3(tie_word_embeddings: bool, seed: int = 0) -> Qwen3ForCausalLM:
    """Random weights, norms included (HF initialises them to ones, which hides mix-ups)."""
    torch.manual_seed(seed)
    config = Qwen3Config(**TINY_QWEN3, tie_word_embeddings=tie_word_embeddings)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def tiny_qwen3_moe(seed: int = 0, norm_topk_prob: bool = False) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        **TINY_QWEN3,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
    )
    return Qwen3MoeForCausalLM(config).eval()


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
