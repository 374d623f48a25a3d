"""Micro-batch planning: token-budget chunks, and splitting them to a common count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relax_hpc.trainer.batch import split_to_count


def test_the_largest_chunk_is_halved_first():
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to_count([[0, 1, 2]], 2) == [[0], [1, 2]]


def test_a_count_already_reached_changes_nothing():
    chunks = [[0, 1], [2]]
    assert split_to_count(chunks, 2) == chunks
    assert split_to_count(chunks, 1) == chunks  # never merges: the budget stays respected


def test_too_few_rows_for_the_count_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot run 4 micro-batches over 3 rows"):
        split_to_count([[0, 1], [2]], 4)


@given(st.lists(st.integers(1, 6), min_size=1, max_size=6), st.integers(1, 12))
def test_rows_and_order_are_kept(sizes, extra):
    rows = iter(range(sum(sizes)))
    chunks = [[next(rows) for _ in range(size)] for size in sizes]
    count = min(len(chunks) + extra, sum(sizes))
    result = split_to_count(chunks, count)
    assert len(result) == count
    assert [row for chunk in result for row in chunk] == list(range(sum(sizes)))
    assert all(chunk for chunk in result)
