"""The resumable prompt sampler."""

from __future__ import annotations

import pytest

from relax_hpc.data.sampler import PromptSampler

DATASET = [f"prompt-{i}" for i in range(10)]


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(DATASET, seed=7)
    first, second = sampler.take(10), sampler.take(10)
    assert sorted(i for i, _ in first) == list(range(10))
    assert sorted(i for i, _ in second) == list(range(10))
    assert [i for i, _ in first] != [i for i, _ in second]
    assert all(DATASET[i] == record for i, record in first + second)
    assert sampler.state_dict()["epoch"] == 1 and sampler.num_consumed == 20


def test_same_seed_same_order_other_seed_other_order():
    assert PromptSampler(DATASET, seed=1).take(25) == PromptSampler(DATASET, seed=1).take(25)
    assert PromptSampler(DATASET, seed=1).take(10) != PromptSampler(DATASET, seed=2).take(10)
    assert [i for i, _ in PromptSampler(DATASET, seed=1, shuffle=False).take(12)] == [
        *range(10),
        0,
        1,
    ]


@pytest.mark.parametrize("steps_before_resume", [0, 3, 10, 13])
def test_resume_from_state_dict_continues_identically(steps_before_resume):
    original = PromptSampler(DATASET, seed=5)
    original.take(steps_before_resume)
    state = original.state_dict()
    resumed = PromptSampler(DATASET, seed=999)  # the checkpoint's seed wins
    resumed.load_state_dict(state)
    assert resumed.take(17) == original.take(17)


def test_resume_on_another_dataset_is_refused():
    state = PromptSampler(DATASET, seed=5).state_dict()
    with pytest.raises(ValueError, match="dataset of 10 prompts"):
        PromptSampler(DATASET[:4], seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="empty"):
        PromptSampler([], seed=5)


def test_seeking_group_by_group_draws_the_stream_whatever_the_order():
    """The rollout seeks to each group's position (load_state_dict) before drawing it; the
    cached permutation of an epoch must never leak into another epoch or seed."""
    stream = PromptSampler(DATASET, seed=3).take(35)
    sampler = PromptSampler(DATASET, seed=3)
    for g in [0, 1, 12, 11, 2, 34, 20, 9, 10, 33, 0]:
        state = sampler.state_dict()
        state.update(epoch=g // len(DATASET), position=g % len(DATASET))
        sampler.load_state_dict(state)
        assert next(sampler) == stream[g], g
    state = sampler.state_dict()
    state.update(seed=4, epoch=0, position=0)
    sampler.load_state_dict(state)
    assert sampler.take(10) == PromptSampler(DATASET, seed=4).take(10)
