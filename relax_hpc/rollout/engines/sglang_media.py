"""The images of SGLang requests: the same model inputs the transformers engine builds, sent
as SGLang's ``processor_output`` beside the prompt's pre-expanded token ids.

A request's ``multimodal`` (``media_request(payload)``: fitted uint8 images) becomes
``{"image": ProcessorOutput(format="processor_output", pixel_values=..., image_grid_thw=...)}``
made by the run's ``MediaProcessor``: the very tensors the trainer rebuilds from the spool,
so SGLang neither resizes nor re-tokenizes anything (``prompt_ids`` already hold one image
pad per image embedding; ``check_prompt_ids`` refuses ids the images do not fill). One item
per request holds all of its images: SGLang's rule for this format
(``BaseMultimodalProcessor.validate_mm_data``, sglang 0.5.x). The samples of a group share
one dict, converted once per call.

The media-token mask is ``sglang_adapter.media_logit_bias``: every markup token gets
``MEDIA_TOKEN_BIAS`` in ``sampling_params.logit_bias``, which SGLang adds to the logits
before sampling and before its log-probs, as ``inputs.mask_media_logits`` does for the
transformers engine and the trainer.

Written against sglang's request API (``GenerateReqInput.image_data``,
``SamplingParams.logit_bias``); checked only on a GPU (tests/gpu/test_sglang_media.py).
Audio through SGLang is not wired yet and is refused.

Must not: import sglang, or talk to a running engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from relax_hpc.media.processor import MediaProcessor
from relax_hpc.rollout.engines.base import GenerationRequest

PROCESSOR_OUTPUT = "processor_output"  # SGLang's MultimodalInputFormat.PROCESSOR_OUTPUT


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
    """``{"image": ProcessorOutput}`` of a request's media (empty for no images)."""
    if media.get("audio"):
        raise ValueError(
            f"request {where}: audio through the SGLang engine is not wired yet; use "
            "rollout.backend=transformers for audio models"
        )
    payload = processor.fit(media.get("image", ()), (), where)
    if not payload.images:
        return {}
    tensors = processor.model_inputs(payload, where).tensors
    return {
        "image": ProcessorOutput(
            format=PROCESSOR_OUTPUT,
            pixel_values=tensors["pixel_values"],
            image_grid_thw=tensors["image_grid_thw"],
        )
    }


def check_filled(
    request: GenerationRequest, converted: dict[str, ProcessorOutput], processor: MediaProcessor
) -> None:
    """The request's image pads are exactly the images' embeddings (stale ids refused)."""
    grid = converted["image"]["image_grid_thw"] if converted else None
    merge = processor.image_processor.merge_size if processor.image_processor else 1
    tokens = int(grid.prod(-1).sum()) // merge**2 if grid is not None else 0
    pad = processor.tokenizer.convert_tokens_to_ids(processor.markup.image_pad)
    found = sum(1 for token in request.prompt_ids if token == pad)
    if found != tokens:
        raise ValueError(
            f"request {request.sample_id}: the prompt holds {found} image tokens, its images "
            f"fill {tokens}; tokenize and process with the same MediaProcessor"
        )
