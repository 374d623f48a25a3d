"""How each supported model family writes media into a prompt, and how many tokens each
item becomes.

A family's chat template renders an image part as ``<|vision_start|><|image_pad|>
<|vision_end|>`` and an audio part as ``audio_start audio_pad audio_end``; the processor then
repeats each pad token once per embedding the model's tower produces for that item: an image
of grid ``(t, h, w)`` patches gives ``t*h*w // merge_size**2`` tokens, a clip of ``n`` feature
frames the family's audio-encoder length (the formulas of the models' own
``_get_feat_extract_output_lengths``, checked against them in the tests).

Must not: import torch or a model; the markup of a loaded model is picked by its
``config.model_type``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MediaMarkup:
    family: str
    modalities: tuple[str, ...]  # of "image", "audio"
    image_pad: str = "<|image_pad|>"
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    video_pad: str = "<|video_pad|>"  # videos are not fed yet; the token is still banned
    audio_pad: str | None = None
    audio_start: str | None = None
    audio_end: str | None = None

    @property
    def image_markup(self) -> str:
        return f"{self.vision_start}{self.image_pad}{self.vision_end}"

    @property
    def audio_markup(self) -> str:
        assert self.audio_pad is not None, f"{self.family} takes no audio"
        return f"{self.audio_start}{self.audio_pad}{self.audio_end}"

    def special_tokens(self) -> list[str]:
        """Every token of the markup (a tokenizer must know each as one special token)."""
        tokens = [self.vision_start, self.vision_end, self.image_pad, self.video_pad]
        return tokens + [t for t in (self.audio_start, self.audio_end, self.audio_pad) if t]

    def num_audio_tokens(self, num_frames: int) -> int:
        """Placeholder tokens of a clip with ``num_frames`` mel frames (hop 10 ms)."""
        if self.family == "qwen3_omni":
            leave = num_frames % 100
            after_conv = (leave - 1) // 2 + 1
            return ((after_conv - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // 100) * 13
        assert self.family == "qwen2_5_omni", f"{self.family} takes no audio"
        return ((num_frames - 1) // 2 + 1 - 2) // 2 + 1


FAMILIES: dict[str, MediaMarkup] = {
    "qwen3_vl": MediaMarkup("qwen3_vl", ("image",)),
    "qwen2_5_vl": MediaMarkup("qwen2_5_vl", ("image",)),
    "qwen2_5_omni": MediaMarkup(
        "qwen2_5_omni",
        ("image", "audio"),
        audio_pad="<|AUDIO|>",
        audio_start="<|audio_bos|>",
        audio_end="<|audio_eos|>",
    ),
    "qwen3_omni": MediaMarkup(
        "qwen3_omni",
        ("image", "audio"),
        audio_pad="<|audio_pad|>",
        audio_start="<|audio_start|>",
        audio_end="<|audio_end|>",
    ),
}
# config.model_type -> family (the thinker is the part of an Omni model that RL trains)
MODEL_TYPES = {
    "qwen3_vl": "qwen3_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen2_5_omni": "qwen2_5_omni",
    "qwen2_5_omni_thinker": "qwen2_5_omni",
    "qwen3_omni_moe": "qwen3_omni",
    "qwen3_omni_moe_thinker": "qwen3_omni",
}


def markup_for_model_type(model_type: str) -> MediaMarkup:
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} takes no media here; supported: {sorted(MODEL_TYPES)}"
        )
    return FAMILIES[MODEL_TYPES[model_type]]
