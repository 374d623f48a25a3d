"""The judge's warm start: rows of the verification task, a cached and keyed verifier."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from test_task_addition import DATA
from test_task_addition import MODEL as POLICY

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.tasks import (
    CANDIDATE_MISTAKES,
    lsd_first,
    verification_candidate,
    wrong_candidate,
)
from relax_hpc.tasks import verifier as verifier_task
from relax_hpc.tasks.addition import WarmStartConfig, warm_start
from relax_hpc.tasks.verifier import VerifierWarmStartConfig, warm_start_verifier
from relax_hpc.tasks.warm_start import warm_started_model_config

MODEL = dataclasses.replace(POLICY, name="judge")
RECIPE = VerifierWarmStartConfig(
    steps=3, batch_size=8, warmup_steps=1, agreement_rows=16, max_attempts=1
)


def test_candidates_are_half_right_and_every_wrong_one_differs_from_the_sum():
    rng = random.Random(0)
    rows = [(a, b, *verification_candidate(a, b, rng)) for a in range(30) for b in range(30)]
    right = [row for row in rows if row[3]]
    assert 0.45 < len(right) / len(rows) < 0.55
    assert all((c == lsd_first(a + b)) == correct for a, b, c, correct in rows)
    assert all(c.isdigit() for _, _, c, _ in rows)


@pytest.mark.parametrize("mistake", CANDIDATE_MISTAKES)
def test_each_kind_of_mistake_is_what_a_weak_policy_writes(mistake):
    rng = random.Random(1)
    candidates = {wrong_candidate(58, 67, mistake, rng) for _ in range(50)}
    truth = lsd_first(125)  # "521"
    expected = {
        "sloppy": lambda c: c == "51",  # 8+7 -> 5 and 5+6 -> 1, both carries forgotten
        "digit": lambda c: len(c) == 3,
        "length": lambda c: len(c) in (2, 4),
        "reversed": lambda c: c == truth[::-1],
        "random": lambda c: c.isdigit(),
    }[mistake]
    assert candidates - {truth} and all(expected(c) for c in candidates - {truth}), candidates


def test_the_verifier_is_cached_keyed_and_measured(tmp_path, monkeypatch):
    folder = warm_start_verifier(MODEL, DATA, tmp_path, RECIPE)
    metadata = json.loads((folder / "warmstart.json").read_text())
    assert folder.name.startswith("verifier-")
    assert metadata["inputs"]["version"] == "verifier-2"
    assert (metadata["seed"], metadata["attempts"]) == (0, 1)
    for key in ("agreement", "true_positive_rate", "true_negative_rate"):
        assert 0.0 <= metadata[key] <= 1.0
    monkeypatch.setattr(verifier_task, "train_verifier", lambda *a: pytest.fail("not cached"))
    assert warm_start_verifier(MODEL, DATA, tmp_path, RECIPE) == folder
    monkeypatch.undo()
    other = warm_start_verifier(MODEL, DATA, tmp_path, dataclasses.replace(RECIPE, seed=1))
    assert other != folder
    policy = warm_start(MODEL, DATA, tmp_path, WarmStartConfig(steps=1, batch_size=4))
    assert policy.name.startswith("warmstart-")  # the policy's own cache, never confused
    assert warm_started_model_config(MODEL, folder).path == str(folder)


def test_a_verifier_below_the_agreement_gate_is_retrained_with_the_next_seed(tmp_path):
    """3 steps cannot reach 0.88 agreement: every seed is tried, the best one is kept and
    the metadata says so."""
    recipe = dataclasses.replace(RECIPE, max_attempts=2, seed=5)
    folder = warm_start_verifier(MODEL, DATA, tmp_path, recipe)
    metadata = json.loads((folder / "warmstart.json").read_text())
    assert metadata["attempts"] == 2 and metadata["seed"] in (5, 6)
    assert metadata["agreement"] < recipe.min_agreement


def test_the_verifier_refuses_other_tasks_and_folders():
    with pytest.raises(ValueError, match="data.kind=synthetic_addition, not jsonl"):
        warm_start_verifier(MODEL, DataConfig(kind="jsonl", path="x"), "/nonexistent")
    with pytest.raises(ValueError, match="judge.model.path=null"):
        warm_start_verifier(dataclasses.replace(MODEL, path="/x"), DATA, "/nonexistent")
