"""Tiny Qwen3 models the tests build from config (nothing is downloaded): one shape, and
the variants tests need written as changes to it, so a test's model is sized in one place.

``ModelConfig.arch`` takes these dicts; ``transformers.Qwen3Config`` takes them as keyword
arguments (plus the tokenizer's ids).
"""

from __future__ import annotations

from typing import Any

import torch

from relax_hpc.config.schema import ModelConfig

# 24k parameters with the character tokenizer (101 tokens). A change here changes every test
# that takes the shape as it is; a test that needs another size names its changes.
TINY_QWEN3: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def tiny_qwen3_arch(**changes: Any) -> dict[str, Any]:
    """``TINY_QWEN3`` with ``changes`` (a new dict: callers may change it)."""
    return {**TINY_QWEN3, **changes}


# head_dim 64: the smallest size every SGLang attention backend supports.
SGLANG_QWEN3 = tiny_qwen3_arch(
    hidden_size=128,
    intermediate_size=256,
    head_dim=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_qwen3_config(arch: dict[str, Any] | None = None, name: str = "t") -> ModelConfig:
    """A built-in model of ``arch`` (default ``TINY_QWEN3``) with the character tokenizer."""
    return ModelConfig(name=name, tokenizer="char", arch=TINY_QWEN3 if arch is None else arch)


def tiny_qwen3(
    arch: dict[str, Any] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Any]:
    """(model, character tokenizer): ``tiny_qwen3_config(arch)`` built with ``seed``."""
    from relax_hpc.models.build import build_causal_lm
    from relax_hpc.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    return build_causal_lm(tiny_qwen3_config(arch), tokenizer, dtype, seed=seed), tokenizer
