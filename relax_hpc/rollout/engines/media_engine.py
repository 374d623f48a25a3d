"""Generation from text + images + audio with a transformers VL/Omni model (Qwen3-VL,
Qwen2.5-Omni / Qwen3-Omni thinker): ``TransformersEngine`` with the media in the prefill.

Everything else is the text engine's: batching, per-sample inverse-CDF sampling seeded by
``(seed, sample_id)``, the log-prob convention, stopping, weight loading. What differs is
where tokens sit: these models give media tokens 3-D rotary positions (time, height, width)
so that the text after an image does not sit at ``prompt length``. The prefill therefore lets
the model place the prompt itself (its own ``get_rope_index``, exactly as
``model.generate`` does, media included) and reads back ``rope_deltas``: each row's next
position minus the padded prompt length. Decoding then passes ``length + step +
rope_deltas`` explicitly, so rows can leave the batch and the KV cache without the model's
cached deltas going stale.

A request's media are ``request.multimodal = {"image": [...], "audio": [...]}``: RGB images
(uint8 arrays or PIL) and float32 mono clips at the feature extractor's rate, e.g.
``media_request(payload)``; the engine's ``MediaProcessor`` turns them into model inputs
(once per distinct media object per call: the samples of a group share one).

Media placeholder tokens are masked out of the policy (``inputs.mask_media_logits``): a
response holding one would break the trainer's forward, which takes every pad token for a
media slot. The trainer masks them the same way, so log-probs agree.

Must not: score, touch the spool, or import the trainer.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from typing import Any

from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from relax_hpc.media.inputs import MediaInputs, collate_media, mask_media_logits
from relax_hpc.media.payload import MediaPayload
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.rollout.engines.base import GenerationRequest
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine


def media_request(payload: MediaPayload) -> dict[str, list[Any]]:
    """``GenerationRequest.multimodal`` for a payload (the keys the SGLang adapter reads)."""
    return {"image": list(payload.images), "audio": list(payload.audio)}


class MediaTransformersEngine(TransformersEngine):
    def __init__(
        self,
        model: PreTrainedModel,
        processor: MediaProcessor,
        policy_version: int = 0,
        max_batch_size: int = 256,
    ) -> None:
        super().__init__(model, processor.tokenizer, policy_version, max_batch_size)
        self.processor = processor
        # The Omni thinker's forward has no logits_to_keep (it returns every position).
        accepts = inspect.signature(model.forward).parameters
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in accepts else {}

    def _prefill(
        self,
        requests: Sequence[GenerationRequest],
        input_ids_BL: Tensor,
        mask_BL: Tensor,
        cache: DynamicCache,
    ) -> tuple[Tensor, Tensor]:
        """The base engine's, with the media in the prompt: a group's samples (one prompt,
        one media object) run through the towers and the prefill once, and get copies."""
        shared = self._shared_rows(requests, input_ids_BL.device)
        if shared is not None:
            firsts_U, index_B = shared
            requests = [requests[row] for row in firsts_U.tolist()]
            input_ids_BL, mask_BL = input_ids_BL[firsts_U], mask_BL[firsts_U]
        media = collate_media(self._media_inputs(requests), self.device)
        out = self.model(
            input_ids=input_ids_BL,
            attention_mask=mask_BL,
            past_key_values=cache,
            use_cache=True,
            **media,
            **self._last_logits_only,
        )
        next_position = input_ids_BL.shape[1] + out.rope_deltas.reshape(-1).to(mask_BL.device)
        logits = self._policy_logits(out.logits[:, -1])
        if shared is None:
            return logits, next_position
        cache.batch_select_indices(index_B)  # each row gets its prompt's keys and values
        return logits[index_B], next_position[index_B]

    def _prefill_key(self, request: GenerationRequest) -> Hashable:
        """Equal prompts with the same media object (a group's) have equal prefills."""
        media = id(request.multimodal) if request.multimodal else None
        return tuple(request.prompt_ids), media

    def _forward(
        self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: DynamicCache
    ) -> Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,  # [B, 1]: the same position on all three rotary axes
            past_key_values=cache,
            use_cache=True,
            **self._last_logits_only,
        )
        return self._policy_logits(out.logits[:, -1])

    def _policy_logits(self, logits_BV: Tensor) -> Tensor:
        return mask_media_logits(logits_BV.float(), self.processor.media_token_ids)

    def _media_inputs(self, requests: Sequence[GenerationRequest]) -> list[MediaInputs | None]:
        processed: dict[int, MediaInputs] = {}  # id(request.multimodal) -> its inputs
        rows: list[MediaInputs | None] = []
        for request in requests:
            media = request.multimodal
            if not media:
                rows.append(None)
                continue
            if id(media) not in processed:
                payload = self.processor.fit(
                    media.get("image", ()), media.get("audio", ()), where=request.sample_id
                )
                processed[id(media)] = self.processor.model_inputs(payload, request.sample_id)
            inputs = processed[id(media)]
            self.processor.check_prompt_ids(request.prompt_ids, inputs, request.sample_id)
            rows.append(inputs)
        return rows
