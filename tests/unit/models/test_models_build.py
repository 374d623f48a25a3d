"""The offline character tokenizer and the model builder."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_qwen3_arch
from transformers import AutoTokenizer

from relax_hpc.config.schema import ModelConfig
from relax_hpc.models.build import build_causal_lm, build_tokenizer, num_parameters, resolve_dtype
from relax_hpc.models.tokenizer import build_char_tokenizer

TINY_ARCH = tiny_qwen3_arch(
    hidden_size=64,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    rope_theta=10000.0,
)


def tiny_model_config(**overrides) -> ModelConfig:
    return dataclasses.replace(
        ModelConfig(name="tiny", tokenizer="char", arch=TINY_ARCH), **overrides
    )


def test_char_tokenizer_round_trips_text():
    tokenizer = build_char_tokenizer()
    text = "37+48=58\n\tHello, World! {x}"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_char_tokenizer_special_tokens_and_unknowns():
    tokenizer = build_char_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer("1<eos>é", add_special_tokens=False)["input_ids"]
    assert ids == [
        tokenizer.convert_tokens_to_ids("1"),
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ]


def test_char_tokenizer_saves_and_loads_with_auto_tokenizer(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "12+34= ok"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.eos_token == tokenizer.eos_token and loaded.pad_token == tokenizer.pad_token
    messages = [{"role": "user", "content": "1+1="}]
    assert loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "user: 1+1=\nassistant: "
    )


def test_tiny_model_builds_deterministically_with_about_130k_parameters():
    cfg = tiny_model_config()
    tokenizer = build_tokenizer(cfg)
    model = build_causal_lm(cfg, tokenizer, seed=3)
    assert 120_000 < num_parameters(model) < 150_000
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    again = build_causal_lm(cfg, tokenizer, seed=3)
    other = build_causal_lm(cfg, tokenizer, seed=4)
    first = model.state_dict()
    assert all(torch.equal(first[k], v) for k, v in again.state_dict().items())
    assert not torch.equal(
        first["model.embed_tokens.weight"], other.state_dict()["model.embed_tokens.weight"]
    )


def test_saved_model_loads_back_from_a_local_folder(tmp_path):
    cfg = tiny_model_config()
    tokenizer = build_tokenizer(cfg)
    model = build_causal_lm(cfg, tokenizer, seed=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    from_path = tiny_model_config(path=str(tmp_path), tokenizer="auto")
    loaded = build_causal_lm(from_path, build_tokenizer(from_path))
    ids = torch.tensor([tokenizer("1+2=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_bad_model_settings_name_the_field():
    with pytest.raises(ValueError, match="model.path"):
        build_causal_lm(tiny_model_config(path="/nonexistent"), build_char_tokenizer())
    with pytest.raises(ValueError, match="model.architecture"):
        build_causal_lm(tiny_model_config(architecture="NoSuchModel"), build_char_tokenizer())
    with pytest.raises(ValueError, match="model.tokenizer"):
        build_tokenizer(tiny_model_config(tokenizer="auto"))
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("float8")
    assert resolve_dtype("auto") == torch.float32
