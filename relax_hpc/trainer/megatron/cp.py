"""Context parallelism (CP) for the Megatron backend: which tokens a CP rank holds, and how
per-token results of all CP ranks come back together.

Megatron's load-balanced causal layout: a (padded) sequence of length L is cut into
2 x CP chunks and rank r holds chunks r and 2 x CP - 1 - r, so every rank gets as much
causal attention work as the others. Rotary embeddings and Transformer Engine's attention
assume exactly this layout; ``SdpaCoreAttention`` (the local spec) follows it too.

It must not import megatron: it works on plain tensors and a process group.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cp_positions(length: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """Global positions (ascending) of the tokens CP rank ``cp_rank`` holds."""
    if length % (2 * cp_size):
        raise ValueError(f"a sequence of {length} tokens does not split into {2 * cp_size} chunks")
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second_start = (2 * cp_size - 1 - cp_rank) * chunk
    second = torch.arange(second_start, second_start + chunk, device=device)
    return torch.cat([first, second])


def split_for_cp(x_BL: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """This rank's columns of a ``[B, L]`` tensor (L divisible by 2 x CP)."""
    return x_BL[:, cp_positions(x_BL.shape[1], cp_size, cp_rank, x_BL.device)]


def gather_from_cp(local: Tensor, group, dim: int = 1) -> Tensor:
    """The whole sequence from every CP rank's part along ``dim``, in global order.

    Differentiable: the backward hands each rank the summed gradient of its own part, so
    when every rank computes the same loss from the gathered tensor its gradients are CP
    times the loss's; Megatron's DDP averages gradients over data x context parallel
    ranks, which cancels that factor.
    """
    from torch.distributed.nn.functional import all_gather

    cp_size = torch.distributed.get_world_size(group)
    parts = all_gather(local.contiguous(), group=group)
    length = local.shape[dim] * cp_size
    index = torch.cat([cp_positions(length, cp_size, r, local.device) for r in range(cp_size)])
    shape = list(local.shape)
    shape[dim] = length
    return local.new_zeros(shape).index_copy(dim, index, torch.cat(list(parts), dim=dim))


def causal_mask_for_cp(local_length: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """``[S, L]`` booleans: may this rank's query i attend to global key j (j <= its position)."""
    length = local_length * cp_size
    queries = cp_positions(length, cp_size, cp_rank, device)
    return torch.arange(length, device=device)[None, :] <= queries[:, None]
