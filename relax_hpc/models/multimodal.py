"""Tiny vision-language and omni models built from config, with an offline tokenizer and
offline processor parts, saved and loaded as ordinary Hugging Face folders.

Families (``relax_hpc.media.markup``): ``qwen3_vl`` -> ``Qwen3VLForConditionalGeneration``,
``qwen2_5_omni`` -> ``Qwen2_5OmniThinkerForConditionalGeneration`` (the thinker: the part of
an Omni model that reads text, images and audio and writes text), ``qwen3_omni`` ->
``Qwen3OmniMoeThinkerForConditionalGeneration``. The tokenizer is the character tokenizer of
``models.tokenizer`` with ChatML and the family's media tokens as special tokens; its chat
template renders typed content parts into the family's markup. The processor parts are a
``Qwen2VLImageProcessor`` (its PIL path: no torchvision) and a ``WhisperFeatureExtractor``
with a 2 s chunk (the real models use 30 s; short chunks keep CPU tests fast).

Must not: download anything, or know about RL.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessor,
    WhisperFeatureExtractor,
)

from relax_hpc.media.markup import FAMILIES, MediaMarkup
from relax_hpc.media.processor import MediaProcessor, read_config
from relax_hpc.models.architectures import ARCHITECTURES, OMNI_THINKERS
from relax_hpc.models.tokenizer import ALPHABET, char_level_backend

THINKER_PREFIX = "thinker."
PAD_TOKEN, IM_START, IM_END, UNK_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
# One vocabulary for every family: ChatML, then each family's media tokens, then characters.
SPECIAL_TOKENS = tuple(
    dict.fromkeys(
        [
            PAD_TOKEN,
            IM_START,
            IM_END,
            UNK_TOKEN,
            *(token for markup in FAMILIES.values() for token in markup.special_tokens()),
        ]
    )
)
AUDIO_CHUNK_S = 2

_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    # 3-D rotary positions (time, height, width) over the 8 rotary pairs of head_dim 16
    "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2]},
}
_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 64,
}
_AUDIO = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 64,
    "d_model": 32,
    "output_dim": 64,
    "max_source_positions": 1500,
}
TINY_ARCH: dict[str, dict[str, Any]] = {
    "qwen3_vl": {
        "text_config": {
            **_TEXT,
            "rope_scaling": {**_TEXT["rope_scaling"], "mrope_interleaved": True},
        },
        "vision_config": {
            **_VISION,
            "patch_size": 16,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
    },
    "qwen2_5_omni": {
        "text_config": _TEXT,
        "vision_config": {
            **_VISION,
            "patch_size": 14,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        "audio_config": {**_AUDIO, "n_window": 50},
    },
    "qwen3_omni": {
        "text_config": {
            **_TEXT,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "rope_scaling": {**_TEXT["rope_scaling"], "mrope_interleaved": True},
        },
        "vision_config": {
            **_VISION,
            "patch_size": 16,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0, 1],
        },
        "audio_config": {
            **_AUDIO,
            "n_window": 50,
            "n_window_infer": 100,
            "conv_chunksize": 50,
            "downsample_hidden_size": 16,
        },
    },
}


def chat_template(markup: MediaMarkup) -> str:
    """ChatML; content is a string or typed parts, media parts rendered as ``markup``."""
    audio = markup.audio_markup if markup.audio_pad else ""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{markup.image_markup}"
        f"{{% elif part['type'] == 'audio' %}}{audio}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def build_media_tokenizer(markup: MediaMarkup) -> PreTrainedTokenizerFast:
    """Characters + ChatML + media tokens; ``<|im_end|>`` ends a turn (EOS), left padding."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *ALPHABET])}
    backend = char_level_backend(vocab, SPECIAL_TOKENS, UNK_TOKEN)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    tokenizer.chat_template = chat_template(markup)
    return tokenizer


def tiny_processor(family: str) -> MediaProcessor:
    """The offline processor of a tiny model of ``family``."""
    markup = FAMILIES[family]
    arch = TINY_ARCH[family]
    patch = arch["vision_config"]["patch_size"]
    factor = patch * arch["vision_config"]["spatial_merge_size"]
    image_processor = Qwen2VLImageProcessor(
        patch_size=patch,
        merge_size=arch["vision_config"]["spatial_merge_size"],
        temporal_patch_size=arch["vision_config"]["temporal_patch_size"],
        # min/max_pixels too: in transformers 4.57 their defaults override ``size``
        min_pixels=factor * factor,
        max_pixels=(4 * factor) ** 2,
        size={"shortest_edge": factor * factor, "longest_edge": (4 * factor) ** 2},
    )
    feature_extractor = None
    if "audio" in markup.modalities:
        feature_extractor = WhisperFeatureExtractor(
            feature_size=arch["audio_config"]["num_mel_bins"],
            sampling_rate=16000,
            chunk_length=AUDIO_CHUNK_S,
            return_attention_mask=True,
        )
    return MediaProcessor(build_media_tokenizer(markup), markup, image_processor, feature_extractor)


def tiny_config(
    family: str, processor: MediaProcessor, arch: Mapping[str, Any] | None = None
) -> transformers.PretrainedConfig:
    """The family's config: ``TINY_ARCH`` deep-merged with ``arch``, token ids from the
    processor's tokenizer."""
    kwargs = tiny_arch(family, arch)
    tokenizer, markup = processor.tokenizer, processor.markup
    ids = tokenizer.convert_tokens_to_ids
    kwargs["text_config"]["vocab_size"] = len(tokenizer)
    kwargs.update(
        image_token_id=ids(markup.image_pad),
        video_token_id=ids(markup.video_pad),
        vision_start_token_id=ids(markup.vision_start),
        vision_end_token_id=ids(markup.vision_end),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if markup.audio_pad:
        kwargs.update(
            audio_token_id=ids(markup.audio_pad),
            audio_start_token_id=ids(markup.audio_start),
            audio_end_token_id=ids(markup.audio_end),
        )
    if family == "qwen2_5_omni":  # this config names its token ids *_index
        for name in ("image", "video", "audio"):
            kwargs[f"{name}_token_index"] = kwargs.pop(f"{name}_token_id")
    model_class = getattr(transformers, ARCHITECTURES[family])
    return model_class.config_class(**kwargs)


def build_tiny_media_model(
    family: str, arch: Mapping[str, Any] | None = None, seed: int = 0
) -> tuple[PreTrainedModel, MediaProcessor]:
    """A randomly initialised tiny model (eval mode, float32) and its processor."""
    if family not in ARCHITECTURES:
        raise ValueError(f"unknown media model family {family!r}; use one of {list(ARCHITECTURES)}")
    processor = tiny_processor(family)
    config = tiny_config(family, processor, arch)
    model_class = getattr(transformers, ARCHITECTURES[family])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.eos_token_id = processor.tokenizer.eos_token_id
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    return model.eval(), processor


def save_media_model(folder: str | Path, model: PreTrainedModel, processor: MediaProcessor) -> Path:
    """Weights, config, tokenizer and ``preprocessor_config.json`` in one HF folder."""
    model.save_pretrained(str(folder))
    processor.save_pretrained(folder)
    return Path(folder)


def load_media_model(
    folder: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, MediaProcessor]:
    """The model (its saved class, eval mode) and processor of a local HF folder; of a whole
    Omni folder (``OMNI_THINKERS``), the thinker alone."""
    # Not AutoConfig: transformers 4.57 maps no model_type "qwen2_5_omni_thinker".
    config = read_config(folder)
    names = config.get("architectures") or []
    if names and names[0] in OMNI_THINKERS:
        model = _load_thinker(folder, config, getattr(transformers, OMNI_THINKERS[names[0]]), dtype)
        return model.eval(), MediaProcessor.from_pretrained(folder)
    model_class = getattr(transformers, names[0], None) if names else None
    if model_class is None:
        raise ValueError(f"{folder}: config.json names no transformers class ({names})")
    model = model_class.from_pretrained(str(folder), local_files_only=True, dtype=dtype)
    return model.eval(), MediaProcessor.from_pretrained(folder)


def _load_thinker(
    folder: str | Path, config: Mapping[str, Any], model_class: type, dtype: torch.dtype
) -> PreTrainedModel:
    """The thinker of a whole Omni folder: its config from ``thinker_config``, its weights
    the ``thinker.`` tensors (transformers strips the class's ``base_model_prefix``); the
    talker's and code2wav's tensors are never materialised as parameters."""
    if not isinstance(config.get("thinker_config"), Mapping):
        raise ValueError(f"{folder}: an Omni config.json without thinker_config")
    assert model_class.base_model_prefix == THINKER_PREFIX.rstrip("."), model_class
    thinker_config = model_class.config_class(**config["thinker_config"])
    with warnings.catch_warnings():  # the talker's tensors are expected to be left unused
        warnings.simplefilter("ignore")
        model, info = model_class.from_pretrained(
            str(folder),
            config=thinker_config,
            local_files_only=True,
            dtype=dtype,
            output_loading_info=True,
        )
    if info["missing_keys"]:  # randomly initialised thinker weights: refuse, never train them
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{folder}: the thinker's {len(missing)} weights (e.g. {missing[0]}) are not in the "
            f"folder's {THINKER_PREFIX}* tensors; give a complete Omni or thinker folder"
        )
    return model


def tiny_arch(family: str, arch: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``TINY_ARCH[family]`` deep-merged with ``arch`` (nested config kwargs)."""
    return _deep_merge(copy.deepcopy(TINY_ARCH[family]), arch or {})


def _deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base
