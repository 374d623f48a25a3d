"""The images and audio of SGLang requests: the same model inputs the transformers engine builds, sent
as SGLang's ``processor_output`` beside the prompt's pre-expanded token ids.

A request's ``multimodal`` (``media_request(payload)``: fitted uint8 images, 16 kHz clips)
becomes ``{"image": ProcessorOutput(format="processor_output", pixel_values=...,
image_grid_thw=...), "audio": ProcessorOutput(format=..., input_features=...,
feature_attention_mask=...)}``, sent as ``image_data`` / ``audio_data``,
made by the run's ``MediaProcessor``: the very tensors the trainer rebuilds from the spool,
so SGLang neither resizes, resamples nor re-tokenizes anything (``prompt_ids`` already hold
one pad per image or audio embedding; ``check_filled`` refuses ids the media do not fill).
One item per request and modality holds all of its images (clips): SGLang's rule for this format
(``BaseMultimodalProcessor.validate_mm_data``, sglang 0.5.x). The samples of a group share
one dict, converted once per call.

The media-token mask is ``sglang_adapter.media_logit_bias``: every markup token gets
``MEDIA_TOKEN_BIAS`` in ``sampling_params.logit_bias``, which SGLang adds to the logits
before sampling and before its log-probs, as ``inputs.mask_media_logits`` does for the
transformers engine and the trainer.

Written against sglang's request API (``GenerateReqInput.image_data`` / ``audio_data``,
``SamplingParams.logit_bias``); checked only on a GPU (tests/gpu/test_sglang_media.py).

Must not: import sglang, or talk to a running engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from relax_hpc.media.processor import MediaProcessor
from relax_hpc.rollout.engines.base import GenerationRequest

PROCESSOR_OUTPUT = "processor_output"  # SGLang's MultimodalInputFormat.PROCESSOR_OUTPUT
# The request key -> the processor tensors of its item; the names SGLang maps to its image and
# audio modality (BaseMultimodalProcessor.ATTR_NAME_TO_MODALITY) and the Omni thinker takes.
MODALITY_TENSORS = {
    "image": ("pixel_values", "image_grid_thw"),
    "audio": ("input_features", "feature_attention_mask"),
}


class ProcessorOutput(dict):
    """A processor output SGLang can read either way: as a mapping (``collect_mm_items_
    from_processor_output``) and by attribute (``getattr(ret, "image_grid_thw")`` in its
    Qwen-VL processor, which takes a dict item as the processor's result)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def sglang_media_requests(
    requests: Sequence[GenerationRequest], processor: MediaProcessor
) -> list[GenerationRequest]:
    """``requests`` with their media as SGLang processor outputs (text-only ones as they are)."""
    converted: dict[int, dict[str, ProcessorOutput]] = {}  # id(request.multimodal) -> SGLang's
    result = []
    for request in requests:
        media = request.multimodal
        if not media:
            result.append(request)
            continue
        if id(media) not in converted:
            converted[id(media)] = processor_output(media, processor, request.sample_id)
        payload_inputs = converted[id(media)]
        check_filled(request, payload_inputs, processor)
        result.append(dataclasses.replace(request, multimodal=payload_inputs or None))
    return result


def processor_output(
    media: dict, processor: MediaProcessor, where: str
) -> dict[str, ProcessorOutput]:
    """``{"image": ProcessorOutput, "audio": ProcessorOutput}`` of a request's media, one
    item per modality holding all of its images / clips (absent where there are none)."""
    payload = processor.fit(media.get("image", ()), media.get("audio", ()), where)
    if payload.is_empty:
        return {}
    tensors = processor.model_inputs(payload, where).tensors
    converted = {}
    for modality, names in MODALITY_TENSORS.items():
        if names[0] in tensors:
            item = {name: tensors[name] for name in names}
            converted[modality] = ProcessorOutput(format=PROCESSOR_OUTPUT, **item)
    return converted


def check_filled(
    request: GenerationRequest, converted: dict[str, ProcessorOutput], processor: MediaProcessor
) -> None:
    """The request's image and audio pads are exactly the media's embeddings (stale ids
    refused)."""
    for kind, items, pad_token, tokens in (
        ("image", "images", processor.markup.image_pad, _image_tokens(converted, processor)),
        ("audio", "clips", processor.markup.audio_pad, _audio_tokens(converted, processor)),
    ):
        if pad_token is None:
            continue
        pad = processor.tokenizer.convert_tokens_to_ids(pad_token)
        found = sum(1 for token in request.prompt_ids if token == pad)
        if found != tokens:
            raise ValueError(
                f"request {request.sample_id}: the prompt holds {found} {kind} tokens, its "
                f"{items} fill {tokens}; tokenize and process with the same MediaProcessor"
            )


def _image_tokens(converted: dict[str, ProcessorOutput], processor: MediaProcessor) -> int:
    if "image" not in converted:
        return 0
    grid = converted["image"]["image_grid_thw"]
    return int(grid.prod(-1).sum()) // processor.image_processor.merge_size**2


def _audio_tokens(converted: dict[str, ProcessorOutput], processor: MediaProcessor) -> int:
    if "audio" not in converted:
        return 0
    frames = converted["audio"]["feature_attention_mask"].sum(-1).tolist()
    return sum(processor.markup.num_audio_tokens(n) for n in frames)
