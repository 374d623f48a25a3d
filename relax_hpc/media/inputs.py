"""Media model inputs of prompts, batched for a forward pass, and micro-batches that count
the towers' work.

``MediaInputs`` are the keyword tensors of one prompt's media (what the model's ``forward``
takes besides ``input_ids``): ``pixel_values`` ``[patches, D]`` and ``image_grid_thw``
``[images, 3]`` for images; ``input_features`` ``[clips, mels, frames]`` and
``feature_attention_mask`` ``[clips, frames]`` for audio. A batch concatenates them in row
order, which is the order in which the model fills the placeholder tokens.

Must not: run a model, or know where the tensors came from (rollout or spool).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

MEDIA_KEYS = ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask")
# Logit of a token the policy must not write. Finite, so that softmax gives it exactly zero
# mass without 0 * inf = NaN in entropies, and still finite after dividing by a temperature.
MASKED_LOGIT = -1.0e9


@dataclass(frozen=True)
class MediaInputs:
    tensors: Mapping[str, Tensor] = field(default_factory=dict)
    num_media_tokens: int = 0  # placeholder tokens these media fill in the prompt
    num_encoder_positions: int = 0  # vision patches + audio frames the towers run over

    def equals(self, other: MediaInputs) -> bool:
        """Bit-identical tensors (same keys, dtypes, shapes and values)."""
        return self.tensors.keys() == other.tensors.keys() and all(
            self.tensors[k].dtype == other.tensors[k].dtype
            and torch.equal(self.tensors[k], other.tensors[k])
            for k in self.tensors
        )


def mask_media_logits(logits_xV: Tensor, media_token_ids: Sequence[int]) -> Tensor:
    """``logits_xV`` with the media placeholder tokens set to ``MASKED_LOGIT`` (out of place).

    Rollout and trainer both apply it, so the policy's distribution (and so every log-prob
    and entropy) is over the vocabulary without media tokens on both sides.
    """
    if not media_token_ids:
        return logits_xV
    ids = torch.as_tensor(media_token_ids, dtype=torch.long, device=logits_xV.device)
    return logits_xV.index_fill(-1, ids, MASKED_LOGIT)


def collate_media(
    rows: Sequence[MediaInputs | None], device: torch.device | str = "cpu"
) -> dict[str, Tensor]:
    """The keyword tensors of a batch whose row ``i`` carries ``rows[i]`` (None: text only)."""
    merged: dict[str, Tensor] = {}
    for key in MEDIA_KEYS:
        parts = [r.tensors[key] for r in rows if r is not None and key in r.tensors]
        if parts:
            merged[key] = torch.cat(parts, dim=0).to(device)
    return merged


@dataclass
class MediaBatch:
    """The media of each row of a trainer batch (rows of one group share one object)."""

    rows: list[MediaInputs | None]

    def select(self, indices: Sequence[int] | Tensor) -> MediaBatch:
        indices = indices.tolist() if isinstance(indices, Tensor) else indices
        return MediaBatch([self.rows[i] for i in indices])

    def model_kwargs(self, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        return collate_media(self.rows, device)

    @property
    def encoder_positions_B(self) -> list[int]:
        return [0 if r is None else r.num_encoder_positions for r in self.rows]


def media_budget_chunks(
    sequence_len_B: Sequence[int], encoder_positions_B: Sequence[int], micro_batch_tokens: int
) -> list[list[int]]:
    """Consecutive row ranges whose cost fits ``micro_batch_tokens``.

    Cost of a micro-batch: rows x its longest sequence (the padded language-model tokens,
    media placeholders included) plus the positions its vision/audio towers run over (4x
    the image tokens at merge size 2, 4x the audio tokens). A row over budget on its own
    still forms its own micro-batch.
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    longest = encoder = 0
    for row, (length, positions) in enumerate(
        zip(sequence_len_B, encoder_positions_B, strict=True)
    ):
        cost = max(longest, length) * (len(current) + 1) + encoder + positions
        if current and cost > micro_batch_tokens:
            chunks.append(current)
            current, longest, encoder = [], 0, 0
        current.append(row)
        longest, encoder = max(longest, length), encoder + positions
    if current:
        chunks.append(current)
    return chunks
