"""The synthetic addition task: answers, determinism, disjoint splits, the sloppy teacher."""

from __future__ import annotations

import random

import pytest

from relax_hpc.data.tasks import AdditionTask, lsd_first, sloppy_answer


def test_answers_are_sums_written_least_significant_digit_first():
    task = AdditionTask(digits=2, eval_size=64)
    for row in [task.train[i] for i in range(0, len(task.train), 97)]:
        assert row["prompt"] == f"{row['a']}+{row['b']}="
        assert row["answer"] == str(row["a"] + row["b"])[::-1]
    assert lsd_first(85) == "58" and lsd_first(100) == "001"


def test_splits_are_deterministic_disjoint_and_cover_every_pair():
    task = AdditionTask(digits=2, eval_size=256)
    again = AdditionTask(digits=2, eval_size=256)
    train = {(r["a"], r["b"]) for r in task.train}
    held_out = {(r["a"], r["b"]) for r in task.eval}
    assert len(held_out) == len(task.eval) == 256
    assert len(train) == len(task.train) == 10_000 - 256
    assert train.isdisjoint(held_out)
    assert list(task.eval) == list(again.eval)
    assert task.train[1234] == again.train[1234]
    assert held_out != {(r["a"], r["b"]) for r in AdditionTask(2, 256, split_seed=1).eval}


def test_large_task_is_indexed_lazily():
    task = AdditionTask(digits=3, eval_size=256)
    assert len(task.train) == 1_000_000 - 256
    last = task.train[-1]
    assert (last["a"], last["b"]) == (999, 999) or task.is_eval_pair(999_999)
    assert not any(
        task.is_eval_pair(task.train_pair_index(i)) for i in range(0, len(task.train), 9973)
    )


def test_sloppy_teacher_forgets_carries_at_the_given_rate():
    rng = random.Random(0)
    assert sloppy_answer(37, 48, 0.0, rng) == "58"
    assert sloppy_answer(37, 48, 1.0, rng) == "57"
    assert sloppy_answer(99, 1, 1.0, rng) == "09"  # both carries forgotten: 0 then 9, no 1
    assert sloppy_answer(12, 34, 0.7, rng) == "64"  # no carry: always right
    right = sum(sloppy_answer(7, 5, 0.7, rng) == "21" for _ in range(4000)) / 4000
    assert right == pytest.approx(0.3, abs=0.03)


def test_bad_task_settings_are_rejected():
    with pytest.raises(ValueError, match="data.digits"):
        AdditionTask(digits=0)
    with pytest.raises(ValueError, match="data.eval_size"):
        AdditionTask(digits=1, eval_size=60)
