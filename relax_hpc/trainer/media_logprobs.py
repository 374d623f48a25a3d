"""Per-token log-probs and entropies of response tokens given prompt + media, in one
forward with a gradient path: what the torch backend computes for a VL/Omni policy.

The batch layout is ``trainer.batch``'s (right-padded prompt + response rows, response
token ``t`` of row ``i`` predicted at position ``prompt_len[i] + t - 1``) plus the rows'
media keyword tensors (``media.inputs.MediaBatch.model_kwargs``). No ``position_ids`` are
passed: the model computes its multimodal rotary positions from ``input_ids``, the media
grids and the attention mask, the same positions the rollout engine's prefill used, so the
log-probs agree with the engine's at the same weights; media placeholder tokens are masked
out of the policy as the engine does. Micro-batches are cut by
``media.inputs.media_budget_chunks`` (language tokens plus the towers' positions).

Must not: know about losses or optimisers, or import the rollout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from relax_hpc.algo import entropy_from_logits
from relax_hpc.media.inputs import mask_media_logits
from relax_hpc.trainer.batch import gather_response


def media_token_logprobs(
    network: torch.nn.Module,
    input_ids_BL: Tensor,
    attention_mask_BL: Tensor | None,
    prompt_len_B: Tensor,
    width: int,
    media_kwargs: Mapping[str, Tensor],
    media_token_ids: Sequence[int] = (),
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``[B, T]`` log-probs of the response tokens at ``temperature`` (and entropies), over
    the vocabulary without ``media_token_ids`` (``MediaProcessor.media_token_ids``), as the
    rollout engine samples."""
    logits_BLV = network(
        input_ids=input_ids_BL, attention_mask=attention_mask_BL, **media_kwargs
    ).logits.float()
    logits_BLV = mask_media_logits(logits_BLV, media_token_ids) / temperature
    next_tokens_BL = torch.roll(input_ids_BL, shifts=-1, dims=1)
    logprobs_BL = (
        torch.log_softmax(logits_BLV, dim=-1).gather(-1, next_tokens_BL.unsqueeze(-1)).squeeze(-1)
    )
    logprobs_BT = gather_response(logprobs_BL, prompt_len_B, width)
    entropy_BT = None
    if with_entropy:
        entropy_BT = gather_response(entropy_from_logits(logits_BLV), prompt_len_B, width)
    return logprobs_BT, entropy_BT
