"""Context-parallel layout: Megatron's load-balanced chunks and the causal mask they need."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.trainer.megatron.cp import causal_mask_for_cp, cp_positions, split_for_cp


@pytest.mark.parametrize(("length", "cp_size"), [(8, 2), (12, 2), (24, 3), (16, 4)])
def test_every_position_is_held_by_exactly_one_rank(length, cp_size):
    held = torch.cat([cp_positions(length, cp_size, r) for r in range(cp_size)])
    assert sorted(held.tolist()) == list(range(length))


def test_rank_r_holds_chunks_r_and_its_mirror():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(16).view(2, 8)
    assert split_for_cp(x, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]


def test_a_length_that_does_not_split_is_an_error():
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        cp_positions(10, 2, 0)


def test_the_mask_lets_a_query_see_global_keys_up_to_its_position():
    mask = causal_mask_for_cp(4, 2, 0)  # rank 0 of 8 tokens holds positions 0, 1, 6, 7
    assert mask.shape == (4, 8)
    assert mask.sum(dim=1).tolist() == [1, 2, 7, 8]
    assert mask[2].tolist() == [True] * 7 + [False]
