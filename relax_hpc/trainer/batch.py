"""From spool groups to padded tensors, and the index arithmetic of response tokens.

Legend: ``B`` samples, ``L`` padded prompt+response length, ``T`` padded response length.
A response token ``t`` of row ``i`` sits at input position ``prompt_len[i] + t`` and is
predicted by the logits at position ``prompt_len[i] + t - 1``.

Media (images, audio) ride along per row (``TrainBatch.media``): the model inputs rebuilt
once per payload object (``Sample.media``: one per group, or one per sample when a
multi-turn environment showed each sample its own images) by the model's
``MediaProcessor``; the prompt ids hold every media token of the prompt, the response the
observation's (loss mask 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from relax_hpc.media.inputs import MediaBatch, MediaInputs, media_budget_chunks
from relax_hpc.media.payload import MediaPayload
from relax_hpc.spool import Sample

if TYPE_CHECKING:
    from relax_hpc.media.processor import MediaProcessor


@dataclass
class TrainBatch:
    input_ids_BL: torch.Tensor  # int64, right-padded with pad_token_id
    attention_mask_BL: torch.Tensor  # int64, 1 on prompt and response tokens
    prompt_len_B: torch.Tensor  # int64
    response_len_B: torch.Tensor  # int64
    response_mask_BT: torch.Tensor  # float32, the loss mask (0 on observation tokens, padding)
    rollout_logprobs_BT: torch.Tensor  # float32
    rewards_B: torch.Tensor  # float32
    group_index_B: torch.Tensor  # int64, dense group ids 0..G-1 in batch order
    policy_version_B: torch.Tensor  # int64, version of the weights that generated each sample
    sample_ids: list[str]
    # Per row its media inputs (rows of a group share one object); None: a text-only batch.
    media: MediaBatch | None = None
    # bool, True where no reward could be computed (Sample.reward_failed); None: none failed
    reward_failed_B: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.input_ids_BL.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask_BL.sum())

    def select(self, rows: torch.Tensor | Sequence[int]) -> TrainBatch:
        """The sub-batch of ``rows``, trimmed to its own longest sequence."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        picked = {
            f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
            for f in fields(self)
            if f.name not in ("sample_ids", "media")
        }
        picked["sample_ids"] = [self.sample_ids[i] for i in rows.tolist()]
        picked["media"] = None if self.media is None else self.media.select(rows)
        return TrainBatch(**picked).trimmed()

    @property
    def encoder_positions_B(self) -> list[int]:
        """Positions the media towers run over per row (0 for text rows)."""
        if self.media is None:
            return [0] * self.num_samples
        return self.media.encoder_positions_B

    def media_kwargs(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The model's media keyword tensors for these rows (none for a text-only batch)."""
        return {} if self.media is None else self.media.model_kwargs(device)

    def trimmed(self) -> TrainBatch:
        """A copy without the padding columns no row needs."""
        length = int((self.prompt_len_B + self.response_len_B).max())
        width = max(int(self.response_len_B.max()), 1)
        return replace(
            self,
            input_ids_BL=self.input_ids_BL[:, :length],
            attention_mask_BL=self.attention_mask_BL[:, :length],
            response_mask_BT=self.response_mask_BT[:, :width],
            rollout_logprobs_BT=self.rollout_logprobs_BT[:, :width],
        )


def collate(
    groups: Sequence[Sequence[Sample]],
    pad_token_id: int,
    processor: MediaProcessor | None = None,
) -> TrainBatch:
    """Pad every sample of ``groups`` (in order) into one ``TrainBatch``; ``processor``
    rebuilds the media inputs of groups that carry media."""
    samples = [sample for group in groups for sample in group]
    group_index = [index for index, group in enumerate(groups) for _ in group]
    if not samples:
        raise ValueError("collate needs at least one sample")
    prompt_len = np.array([len(s.prompt_token_ids) for s in samples], dtype=np.int64)
    response_len = np.array([len(s.response_token_ids) for s in samples], dtype=np.int64)
    width = max(int(response_len.max()), 1)
    tokens = [t for s in samples for t in (s.prompt_token_ids, s.response_token_ids)]
    input_ids, filled = _right_padded(
        tokens, prompt_len + response_len, dtype=np.int64, pad=pad_token_id
    )
    return TrainBatch(
        input_ids_BL=input_ids,
        attention_mask_BL=torch.from_numpy(filled.astype(np.int64)),
        prompt_len_B=torch.from_numpy(prompt_len),
        response_len_B=torch.from_numpy(response_len),
        response_mask_BT=_right_padded([s.loss_mask for s in samples], response_len, width)[0],
        rollout_logprobs_BT=_right_padded(
            [s.rollout_logprobs for s in samples], response_len, width
        )[0],
        rewards_B=torch.tensor([float(s.reward) for s in samples], dtype=torch.float32),
        group_index_B=torch.tensor(group_index, dtype=torch.long),
        policy_version_B=torch.tensor([s.policy_version for s in samples], dtype=torch.long),
        sample_ids=[s.sample_id for s in samples],
        media=collate_group_media(groups, processor),
        reward_failed_B=torch.tensor([s.reward_failed for s in samples], dtype=torch.bool),
    )


def _right_padded(
    pieces: Sequence,
    row_len: np.ndarray,
    width: int | None = None,
    dtype: type = np.float32,
    pad: int = 0,
) -> tuple[torch.Tensor, np.ndarray]:
    """``row_len[i]`` consecutive elements of the concatenated ``pieces`` per row,
    left-aligned in a ``[B, width]`` array of ``pad``, and where the rows' elements are: one
    concatenation and one masked store instead of a copy per row."""
    values = np.concatenate([np.asarray(p).reshape(-1) for p in pieces])
    width = int(row_len.max()) if width is None else width
    filled = np.arange(width)[None, :] < row_len[:, None]
    out = np.full(filled.shape, pad, dtype=dtype)
    out[filled] = values
    return torch.from_numpy(out), filled


def collate_group_media(
    groups: Sequence[Sequence[Sample]], processor: MediaProcessor | None
) -> MediaBatch | None:
    """One ``MediaInputs`` per row, built once per payload object (a group's rows share
    it); None when no sample has media (the text path stays as it was)."""
    if all(s.media is None for group in groups for s in group):
        return None
    if processor is None:
        raise ValueError(
            "the spool holds samples with images/audio but the trainer's model takes text "
            "only; set model.modality (vision | audio | omni) and a media model"
        )
    built: dict[int, MediaInputs] = {}  # id(payload) -> its inputs
    rows: list[MediaInputs | None] = []
    for sample in (s for group in groups for s in group):
        rows.append(_sample_inputs(sample, processor, built))
    return MediaBatch(rows)


def _sample_inputs(
    sample: Sample, processor: MediaProcessor, built: dict[int, MediaInputs]
) -> MediaInputs | None:
    payload: MediaPayload | None = sample.media
    if payload is None or payload.is_empty:
        return None
    where = f"sample {sample.sample_id}"
    if id(payload) not in built:
        built[id(payload)] = processor.model_inputs(payload, where)
    inputs = built[id(payload)]
    # Pads in the response are a multi-turn observation's images (the policy never writes one).
    ids = [*sample.prompt_token_ids.tolist(), *sample.response_token_ids.tolist()]
    processor.check_prompt_ids(ids, inputs, where)
    return inputs


def response_positions(prompt_len_B: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, T]`` positions of the logits that predict each response token."""
    offsets = torch.arange(width, dtype=torch.long).unsqueeze(0)
    return (prompt_len_B.unsqueeze(1) - 1 + offsets).clamp(min=0)


def gather_response(
    per_position_BLx: torch.Tensor, prompt_len_B: torch.Tensor, width: int
) -> torch.Tensor:
    """Pick the response window ``[B, T]`` out of a per-position ``[B, L]`` tensor.

    Positions past the end of a row are clamped; the response mask removes them.
    """
    positions = response_positions(prompt_len_B, width).to(per_position_BLx.device)
    positions = positions.clamp(max=per_position_BLx.shape[1] - 1)
    return per_position_BLx.gather(1, positions)


def concat_rows(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Rows of micro-batches, each trimmed to its own width, re-padded to ``width``."""
    padded = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(padded, dim=0)


def token_budget_chunks(batch: TrainBatch, micro_batch_tokens: int) -> list[list[int]]:
    """Consecutive row ranges whose padded size (rows x longest row, media tokens included)
    plus the positions the media towers run over fits the budget.

    A single row longer than the budget still forms its own micro-batch.
    """
    lengths = (batch.prompt_len_B + batch.response_len_B).tolist()
    return media_budget_chunks(lengths, batch.encoder_positions_B, micro_batch_tokens)


def split_to_count(chunks: list[list[int]], count: int) -> list[list[int]]:
    """``chunks`` with the largest ones halved until there are ``count`` (rows and order kept).

    Ranks that exchange tokens in every forward (Megatron's MoE dispatch over expert
    parallelism) must run the same number of micro-batches; splitting keeps the result,
    because the loss is normalised by global counts, not per micro-batch.
    """
    chunks = [list(chunk) for chunk in chunks]
    while len(chunks) < count:
        index = max(range(len(chunks)), key=lambda k: len(chunks[k]))
        rows = chunks[index]
        if len(rows) < 2:
            raise ValueError(
                f"cannot run {count} micro-batches over {sum(map(len, chunks))} rows; "
                "give every data-parallel rank the same number of samples"
            )
        chunks[index : index + 1] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return chunks
