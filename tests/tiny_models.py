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


TRANSFORMERS5_ROPE_THETA = 1_000_000.0  # Qwen3's; 4.x's default (10000) must not win


def write_transformers5_folder(folder):
    """A tiny Qwen3 model folder laid out as transformers 5 saves it, built offline.

    transformers 5 cannot be installed beside the pinned 4.x, so the folder is saved with
    4.x and the fields that 5 writes differently are rewritten as 5 writes them (its
    ``tokenization_utils_base.save_pretrained`` and ``Qwen3Config``):
    - tokenizer_config.json: ``"tokenizer_class": "TokenizersBackend"`` (v5's generic fast
      tokenizer class); no ``added_tokens_decoder`` and no ``additional_special_tokens``
      (v5 drops both for TokenizersBackend tokenizers); ``extra_special_tokens`` as a list;
      no special_tokens_map.json; the chat template only in chat_template.jinja;
    - config.json: ``rope_parameters: {rope_type, rope_theta}`` in place of ``rope_theta``
      and ``rope_scaling``; ``dtype`` (not ``torch_dtype``); ``transformers_version`` 5.
    Returns the model as saved, for comparisons.
    """
    import json

    import transformers

    from relax_hpc.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    config = transformers.Qwen3Config(
        **tiny_qwen3_arch(max_position_embeddings=256),
        rope_theta=TRANSFORMERS5_ROPE_THETA,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["tokenizer_class"] = "TokenizersBackend"
    settings["extra_special_tokens"] = settings.pop("additional_special_tokens")
    settings.pop("added_tokens_decoder")
    settings.pop("chat_template", None)
    assert (folder / "chat_template.jinja").is_file()
    settings_path.write_text(json.dumps(settings, indent=2, sort_keys=True))
    (folder / "special_tokens_map.json").unlink()

    config_path = folder / "config.json"
    written = json.loads(config_path.read_text())
    rope_theta = written.pop("rope_theta")
    written.pop("rope_scaling")
    written["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    written["transformers_version"] = "5.0.0"
    assert "dtype" in written and "torch_dtype" not in written
    config_path.write_text(json.dumps(written, indent=2, sort_keys=True))
    return model, tokenizer
