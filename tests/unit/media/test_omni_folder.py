"""A whole Qwen2.5/3-Omni folder (thinker + talker weights, as Qwen publishes them) loads
as its thinker alone, trains as a run's policy, and exports a thinker folder that loads back."""

from __future__ import annotations

import json

import pytest
import torch
from media_fixtures import left_padded, random_image, tone
from safetensors.torch import save_file

from relax_hpc.config.errors import ConfigError
from relax_hpc.config.schema import ModelConfig
from relax_hpc.media.inputs import collate_media
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.models.multimodal import build_tiny_media_model, load_media_model, save_media_model

WHOLE = {
    "qwen2_5_omni": ("Qwen2_5OmniForConditionalGeneration", "qwen2_5_omni"),
    "qwen3_omni": ("Qwen3OmniMoeForConditionalGeneration", "qwen3_omni_moe"),
}


def write_whole_omni(folder, thinker, processor, family, drop=()):
    """What a published Omni folder holds: one config with thinker_config and talker_config,
    thinker weights under ``thinker.``, talker weights beside them, the processor files."""
    folder.mkdir()
    architecture, model_type = WHOLE[family]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "thinker_config": thinker.config.to_dict(),
        "talker_config": {"hidden_size": 16},
        "enable_audio_output": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {f"thinker.{k}": v.contiguous() for k, v in thinker.state_dict().items()}
    tensors = {k: v for k, v in tensors.items() if not any(d in k for d in drop)}
    generator = torch.Generator().manual_seed(0)
    tensors["talker.model.embed_tokens.weight"] = torch.randn(32, 16, generator=generator)
    tensors["talker.codec_head.weight"] = torch.randn(32, 16, generator=generator)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    processor.save_pretrained(folder)
    return folder


def omni_batch(processor):
    prompts = [("<image> which pitch? <audio>", [random_image(56, 56)], [tone(1.0)])]
    processed = [processor.process(*prompt) for prompt in prompts]
    ids, mask = left_padded(processor, processed)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        **collate_media([p.inputs for p in processed]),
    }


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_a_whole_omni_folder_loads_its_thinker_alone_and_exports_one(family, tmp_path):
    thinker, processor = build_tiny_media_model(family, seed=5)
    folder = write_whole_omni(tmp_path / "whole", thinker, processor, family)
    cfg = ModelConfig(path=str(folder), modality="omni", tokenizer="auto")
    loaded, loaded_processor = build_media_policy(cfg)
    assert type(loaded) is type(thinker)
    assert not any(name.startswith("talker") for name, _ in loaded.named_parameters())
    weights = thinker.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in loaded.state_dict().items())
    inputs = omni_batch(loaded_processor)
    with torch.no_grad():
        expected = thinker(**inputs).logits
        assert torch.equal(loaded(**inputs).logits, expected)
    # The run's export writes the thinker and its processor; transformers loads it back.
    exported = save_media_model(tmp_path / "export", loaded, loaded_processor)
    assert json.loads((exported / "config.json").read_text())["architectures"] == [
        type(thinker).__name__
    ]
    again, again_processor = load_media_model(exported)
    assert again_processor.fingerprint == processor.fingerprint
    with torch.no_grad():
        assert torch.equal(again(**omni_batch(again_processor)).logits, expected)


def test_a_whole_omni_folder_missing_thinker_weights_is_refused(tmp_path):
    thinker, processor = build_tiny_media_model("qwen2_5_omni", seed=5)
    folder = write_whole_omni(
        tmp_path / "whole", thinker, processor, "qwen2_5_omni", ["audio_tower"]
    )
    with pytest.raises(ConfigError, match="thinker's .* weights .* are not in the folder"):
        build_media_policy(ModelConfig(path=str(folder), modality="omni", tokenizer="auto"))
