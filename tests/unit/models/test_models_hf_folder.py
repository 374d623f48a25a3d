"""Bring your own model: folders written by transformers 5, and folders that cannot load."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from relax_hpc.config import ConfigError
from relax_hpc.models.build import load_causal_lm
from relax_hpc.models.hf_folder import load_model_config, load_tokenizer


def test_the_fixture_is_one_the_installed_transformers_cannot_read_alone(transformers5_folder):
    folder, _, _ = transformers5_folder
    with pytest.raises(ValueError, match="TokenizersBackend"):
        AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def test_a_transformers5_tokenizer_falls_back_to_tokenizer_json(transformers5_folder):
    folder, _, saved = transformers5_folder
    tokenizer = load_tokenizer(folder)
    text = "Find x.<|im_end|>"
    assert tokenizer(text)["input_ids"] == saved(text)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == len(saved) - 1
    assert "<|im_end|>" in tokenizer.all_special_tokens
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tokenizer, name) == getattr(saved, name), name
    assert (tokenizer.chat_template, tokenizer.padding_side) == (saved.chat_template, "left")


def test_a_transformers5_config_keeps_its_rope_theta(transformers5_folder):
    folder, saved_model, saved_tokenizer = transformers5_folder
    # the value transformers 5 wrote under rope_parameters, not 4.x's default of 10000
    written = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert load_model_config(folder).rope_theta == written["rope_theta"] != 10000.0
    model = load_causal_lm(str(folder), torch.float32)
    ids = torch.tensor([saved_tokenizer("The area is 12 cm^2. " * 6)["input_ids"]])
    with torch.no_grad():  # positions far apart: a wrong rope_theta changes the logits
        assert torch.allclose(model(ids).logits, saved_model(ids).logits, atol=1e-5)


def test_a_folder_that_cannot_load_is_a_config_error_naming_it(broken_model_folder):
    broken = broken_model_folder
    with pytest.raises(ConfigError) as err:
        load_causal_lm(str(broken), torch.float32)
    assert err.value.field == "model.path" and str(broken) in str(err.value)
    assert "safetensors" in str(err.value).lower()

    (broken / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ConfigError, match="no config.json transformers"):
        load_model_config(broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="no tokenizer.json to fall back to"):
        load_tokenizer(broken, "model.path")
