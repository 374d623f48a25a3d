"""The one place where a prompt and its decoded media become model inputs, for rollout and
trainer alike, with the model's own processor parts (image processor, feature extractor,
tokenizer and chat template).

``MediaProcessor.process(prompt, images, audio)`` does it all: the prompt (chat messages
with typed content parts ``{"type": "image" | "audio" | "text"}``, or a text with
``<image>``/``<audio>`` marks) is rendered by the chat template, each media part becomes the
family's markup, each pad token is repeated once per embedding its item produces (so
``prompt_ids`` already hold every media token), and the media become a ``MediaPayload``
(what the spool stores) and ``MediaInputs`` (what the model takes). The trainer rebuilds
the inputs from a stored payload with ``model_inputs(payload)``: the same code on the same
arrays, hence bit-identical tensors.

Must not: decode files (``decode`` does), run a model, or know about the spool's layout.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers import (
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoTokenizer,
    FeatureExtractionMixin,
    ImageProcessingMixin,
)
from transformers.image_transforms import resize
from transformers.image_utils import ChannelDimension
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.media.errors import MediaError
from relax_hpc.media.inputs import MediaInputs
from relax_hpc.media.markup import MediaMarkup, markup_for_model_type
from relax_hpc.media.payload import MediaPayload

PLACEHOLDERS = {"<image>": "image", "<audio>": "audio"}
_PLACEHOLDER_RE = re.compile("(" + "|".join(map(re.escape, PLACEHOLDERS)) + ")")
PREPROCESSOR_CONFIG = "preprocessor_config.json"
Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class ProcessedPrompt:
    text: str  # the rendered prompt, every pad token expanded
    prompt_ids: list[int]
    payload: MediaPayload
    inputs: MediaInputs


class MediaProcessor:
    """Prompt + decoded media -> token ids and media tensors, for one model family."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        markup: MediaMarkup,
        image_processor: ImageProcessingMixin | None = None,
        feature_extractor: FeatureExtractionMixin | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.markup = markup
        self.image_processor = image_processor
        self.feature_extractor = feature_extractor
        unknown = [t for t in markup.special_tokens() if t not in tokenizer.get_vocab()]
        if unknown:
            raise ValueError(
                f"the tokenizer lacks the {markup.family} media tokens {unknown}; "
                "use the model's own tokenizer"
            )

    @cached_property
    def media_token_ids(self) -> tuple[int, ...]:
        """Ids of every markup token: a policy must never write them (the model would take a
        response's pad token for a media slot); see ``inputs.mask_media_logits``."""
        vocab = self.tokenizer.get_vocab()
        return tuple(sorted({vocab[t] for t in self.markup.special_tokens()}))

    @property
    def sampling_rate_hz(self) -> int:
        return int(self.feature_extractor.sampling_rate) if self.feature_extractor else 16000

    @cached_property
    def fingerprint(self) -> str:
        """Hash of everything that changes the media inputs (markup and processor settings)."""
        parts = {"markup": self.markup.__dict__}
        for name, part in (("image", self.image_processor), ("audio", self.feature_extractor)):
            if part is not None:
                parts[name] = {"class": type(part).__name__, **_init_settings(part)}
        blob = json.dumps(parts, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def process(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        images: Sequence[Image.Image | np.ndarray] = (),
        audio: Sequence[np.ndarray] = (),
        *,
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        where: str = "prompt",
    ) -> ProcessedPrompt:
        """THE function: a prompt and its decoded media as token ids and model inputs."""
        messages = chat_messages(
            prompt, system_prompt, num_images=len(images), num_audio=len(audio)
        )
        slots = media_part_counts(messages)
        if slots != (len(images), len(audio)):
            raise MediaError(
                where,
                f"the prompt has {slots[0]} image and {slots[1]} audio slots for "
                f"{len(images)} images and {len(audio)} clips",
                "give one {'type': 'image'|'audio'} part (or <image>/<audio> mark) per item",
            )
        payload = self.fit(images, audio, where)
        inputs = self.model_inputs(payload, where)
        if apply_chat_template:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:
            text = render_plain(messages, self.markup)
        text = self._expand(text, inputs, where)
        ids = self.tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"]
        return ProcessedPrompt(text, list(ids), payload, inputs)

    def fit(
        self,
        images: Sequence[Image.Image | np.ndarray],
        audio: Sequence[np.ndarray],
        where: str = "prompt",
    ) -> MediaPayload:
        """Images resized as the image processor would; clips checked against its chunk."""
        return MediaPayload(
            images=tuple(self._fit_image(image, where) for image in images),
            audio=tuple(self._fit_clip(clip, where) for clip in audio),
            sampling_rate_hz=self.sampling_rate_hz,
            fingerprint=self.fingerprint,
        )

    def model_inputs(self, payload: MediaPayload, where: str = "prompt") -> MediaInputs:
        """The media tensors of ``payload``; bit-identical wherever it runs."""
        if payload.fingerprint != self.fingerprint:
            raise MediaError(
                where,
                f"media fitted for processor {payload.fingerprint}, this one is {self.fingerprint}",
                "build rollout and trainer processors from the same model folder",
            )
        tensors: dict[str, Any] = {}
        tokens = positions = 0
        if payload.images:
            out = self.image_processor(images=list(payload.images), return_tensors="pt")
            grid = out["image_grid_thw"].long()
            tensors["pixel_values"] = out["pixel_values"].float()
            tensors["image_grid_thw"] = grid
            tokens += int(grid.prod(-1).sum()) // self.image_processor.merge_size**2
            positions += int(grid.prod(-1).sum())
        if payload.audio:
            out = self.feature_extractor(
                list(payload.audio),
                sampling_rate=self.sampling_rate_hz,
                padding="max_length",
                return_attention_mask=True,
                return_tensors="pt",
            )
            mask = out["attention_mask"].long()
            tensors["input_features"] = out["input_features"].float()
            tensors["feature_attention_mask"] = mask
            frames = mask.sum(-1).tolist()
            tokens += sum(self.markup.num_audio_tokens(n) for n in frames)
            positions += sum(frames)
        return MediaInputs(tensors, tokens, positions)

    def expand(self, text: str, payload: MediaPayload, where: str = "prompt") -> str:
        """``text`` (rendered markup, one pad per item) with each pad repeated once per
        embedding of its item in ``payload``: e.g. a multi-turn observation's images."""
        return self._expand(text, self.model_inputs(payload, where), where)

    def check_prompt_ids(
        self, prompt_ids: Sequence[int], inputs: MediaInputs, where: str = "prompt"
    ) -> None:
        """Refuse token ids whose media tokens the media do not fill (stale processors)."""
        pads = [self.markup.image_pad, self.markup.audio_pad]
        pad_ids = {self.tokenizer.convert_tokens_to_ids(t) for t in pads if t}
        found = sum(1 for token in prompt_ids if token in pad_ids)
        if found != inputs.num_media_tokens:
            raise MediaError(
                where,
                f"the prompt holds {found} media tokens, its media fill {inputs.num_media_tokens}",
                "tokenize and process with the same MediaProcessor (same model folder)",
            )

    def save_pretrained(self, folder: str | Path) -> None:
        """Tokenizer files and one ``preprocessor_config.json`` holding every processor part
        (as Qwen's Omni folders do: each part's loader reads its own keys)."""
        self.tokenizer.save_pretrained(str(folder))
        merged: dict[str, Any] = {}
        for part in (self.image_processor, self.feature_extractor):
            if part is not None:
                merged.update(json.loads(part.to_json_string()))
        (Path(folder) / PREPROCESSOR_CONFIG).write_text(json.dumps(merged, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> MediaProcessor:
        """From a local model folder: the family from ``config.json``, the parts it needs."""
        markup = markup_for_model_type(str(read_config(folder).get("model_type")))
        folder = str(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        image_processor = feature_extractor = None
        if "image" in markup.modalities:
            image_processor = AutoImageProcessor.from_pretrained(
                folder, local_files_only=True, use_fast=False
            )
        if "audio" in markup.modalities:
            feature_extractor = AutoFeatureExtractor.from_pretrained(folder, local_files_only=True)
        return cls(tokenizer, markup, image_processor, feature_extractor)

    def _fit_image(self, image: Image.Image | np.ndarray, where: str) -> np.ndarray:
        if self.image_processor is None:
            raise MediaError(where, f"{self.markup.family} takes no images", "drop the images")
        array = np.asarray(image.convert("RGB") if isinstance(image, Image.Image) else image)
        assert array.dtype == np.uint8 and array.ndim == 3 and array.shape[2] == 3, array.shape
        processor = self.image_processor
        try:
            height, width = smart_resize(
                array.shape[0],
                array.shape[1],
                factor=processor.patch_size * processor.merge_size,
                min_pixels=processor.size["shortest_edge"],
                max_pixels=processor.size["longest_edge"],
            )
        except ValueError as error:
            raise MediaError(where, str(error), "crop the image to a saner aspect") from None
        if (height, width) == array.shape[:2]:
            return np.ascontiguousarray(array)
        # transformers' own resize (PIL, the processor's filter): the processor's resize of
        # the result is then the identity, and its output equals processing the original.
        return np.ascontiguousarray(
            resize(
                array,
                (height, width),
                resample=processor.resample,
                input_data_format=ChannelDimension.LAST,
            )
        )

    def _fit_clip(self, clip: np.ndarray, where: str) -> np.ndarray:
        extractor = self.feature_extractor
        if extractor is None:
            raise MediaError(where, f"{self.markup.family} takes no audio", "drop the audio")
        clip = np.ascontiguousarray(clip, dtype=np.float32)
        if clip.ndim != 1:
            raise MediaError(where, f"audio must be mono (T,), got {clip.shape}", "mix it down")
        if clip.shape[0] > extractor.n_samples:
            raise MediaError(
                where,
                f"{clip.shape[0] / self.sampling_rate_hz:.2f} s of audio exceed the "
                f"feature extractor's {extractor.chunk_length} s chunk",
                "trim the clip (or use a feature extractor with a longer chunk_length)",
            )
        frames = -(-clip.shape[0] // extractor.hop_length)
        if self.markup.num_audio_tokens(frames) < 1:
            raise MediaError(
                where,
                f"a clip of {clip.shape[0]} samples is too short for one audio token",
                "drop the clip or pad it with silence",
            )
        return clip

    def _expand(self, text: str, inputs: MediaInputs, where: str) -> str:
        """Repeat the k-th image/audio pad token as often as the k-th item's embeddings."""
        item_tokens = self._counts(inputs)  # pad token -> tokens of each item, in order
        remaining = {token: iter(counts) for token, counts in item_tokens.items()}
        found = dict.fromkeys(item_tokens, 0)
        pieces, position = [], 0
        for match in re.finditer("|".join(map(re.escape, item_tokens)), text):
            token = match.group(0)
            found[token] += 1
            pieces += [text[position : match.start()], token * next(remaining[token], 1)]
            position = match.end()
        expected = {token: len(counts) for token, counts in item_tokens.items()}
        if found != expected:
            raise MediaError(
                where,
                f"the rendered prompt holds media tokens {found}, the media need {expected}",
                "use a chat template that renders {'type': 'image'|'audio'} parts "
                "as the model's media markup (the model's own template)",
            )
        return "".join(pieces) + text[position:]

    def _counts(self, inputs: MediaInputs) -> dict[str, list[int]]:
        counts = {self.markup.image_pad: self._image_token_counts(inputs)}
        if self.markup.audio_pad:
            counts[self.markup.audio_pad] = self._audio_token_counts(inputs)
        return counts

    def _image_token_counts(self, inputs: MediaInputs) -> list[int]:
        grid = inputs.tensors.get("image_grid_thw")
        if grid is None:
            return []
        return (grid.prod(-1) // self.image_processor.merge_size**2).tolist()

    def _audio_token_counts(self, inputs: MediaInputs) -> list[int]:
        mask = inputs.tensors.get("feature_attention_mask")
        if mask is None:
            return []
        return [self.markup.num_audio_tokens(n) for n in mask.sum(-1).tolist()]


def chat_messages(
    prompt: str | Sequence[Mapping[str, Any]],
    system_prompt: str | None,
    num_images: int = 0,
    num_audio: int = 0,
) -> Messages:
    """Chat messages whose contents are typed part lists (``<image>``/``<audio>`` marks in
    text become parts). A single text without any mark gets its media in front of it."""
    if isinstance(prompt, str):
        parts = text_parts(prompt)
        if (num_images or num_audio) and not any(p["type"] != "text" for p in parts):
            parts = [*[{"type": "image"}] * num_images, *[{"type": "audio"}] * num_audio, *parts]
        messages = [{"role": "user", "content": parts}]
    else:
        messages = [{**m, "content": content_parts(m["content"])} for m in prompt]
    if system_prompt is not None:
        messages = [{"role": "system", "content": content_parts(system_prompt)}, *messages]
    return messages


def content_parts(content: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return text_parts(content)
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts += text_parts(part.get("text") or "")
        elif kind in ("image", "audio"):
            parts.append({"type": kind})
        else:
            raise MediaError(
                "prompt",
                f"content part type {kind!r} is not supported",
                "use parts of type text, image or audio",
            )
    return parts


def text_parts(text: str) -> list[dict[str, Any]]:
    """``"a <image> b"`` -> text, image, text parts (empty texts dropped)."""
    parts = []
    for piece in _PLACEHOLDER_RE.split(text):
        if piece in PLACEHOLDERS:
            parts.append({"type": PLACEHOLDERS[piece]})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def media_part_counts(messages: Messages) -> tuple[int, int]:
    kinds = [p["type"] for m in messages for p in m["content"]]
    return kinds.count("image"), kinds.count("audio")


def render_plain(messages: Messages, markup: MediaMarkup) -> str:
    """Without a chat template: the parts of every message, media as the family's markup."""
    markups = {"image": markup.image_markup}
    if markup.audio_pad:
        markups["audio"] = markup.audio_markup
    return "".join(
        part["text"] if part["type"] == "text" else markups[part["type"]]
        for message in messages
        for part in message["content"]
    )


def read_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict (AutoConfig in transformers 4.57 does not
    know every model type, e.g. ``qwen2_5_omni_thinker``)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json; give a Hugging Face model folder")
    return json.loads(path.read_text(encoding="utf-8"))


def _init_settings(part: Any) -> dict[str, Any]:
    """The settings of a processor part that its constructor takes (no bookkeeping keys)."""
    names = set(inspect.signature(type(part).__init__).parameters) - {"self", "kwargs"}
    return {k: v for k, v in part.to_dict().items() if k in names}
