"""grpo_tiny_rm's reward model warm start: a score head trained on right and wrong sums,
cached and keyed, whose scores rank right answers above wrong ones."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from test_task_addition import DATA
from test_task_addition import MODEL as POLICY

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.tasks import lsd_first, sloppy_answer
from relax_hpc.rollout.rewards.reward_model import RewardModelScorer, load_reward_model
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.tasks import scorer as scorer_task
from relax_hpc.tasks.scorer import ScorerWarmStartConfig, warm_start_scorer

MODEL = dataclasses.replace(
    POLICY,
    name="rm",
    architecture="Qwen3ForSequenceClassification",
    arch={**POLICY.arch, "num_labels": 1},
)
RECIPE = ScorerWarmStartConfig(
    steps=150, batch_size=32, lr=1e-2, warmup_steps=5, measure_rows=128, max_attempts=1
)


def test_the_scorer_is_cached_keyed_and_ranks_right_sums_first(tmp_path, monkeypatch):
    folder = warm_start_scorer(MODEL, DATA, tmp_path, RECIPE)
    metadata = json.loads((folder / "warmstart.json").read_text())
    assert folder.name.startswith("scorer-") and metadata["inputs"]["version"] == "scorer-1"
    assert (metadata["seed"], metadata["attempts"]) == (0, 1)
    assert metadata["auc"] > 0.75, metadata  # 0.5 is a head that knows nothing
    monkeypatch.setattr(scorer_task, "train_scorer", lambda *a: pytest.fail("not cached"))
    assert warm_start_scorer(MODEL, DATA, tmp_path, RECIPE) == folder
    monkeypatch.undo()
    # The folder is a normal HF folder: loaded and scored as a user's reward model is.
    model, tokenizer = load_reward_model(str(folder), "rm", label=0)
    scorer = RewardModelScorer(model, tokenizer, normalize="sigmoid")
    # What the policy's warm start writes most: the sum with its carry forgotten.
    pairs = [(a, b) for a in range(10) for b in range(10) if a + b >= 10]
    right = scorer.score([ScoreItem(lsd_first(a + b), "", {}, f"{a}+{b}=") for a, b in pairs])
    wrong = scorer.score(
        [
            ScoreItem(sloppy_answer(a, b, 1.0, random.Random(0)), "", {}, f"{a}+{b}=")
            for a, b in pairs
        ]
    )
    ranked = sum(r.score > w.score for r, w in zip(right, wrong, strict=True))
    assert ranked > 0.7 * len(pairs)
    assert all(0.0 < r.score < 1.0 for r in right + wrong)


def test_the_scorer_refuses_other_tasks_and_heads():
    with pytest.raises(ValueError, match="data.kind=synthetic_addition, not jsonl"):
        warm_start_scorer(MODEL, DataConfig(kind="jsonl", path="x"), "/nonexistent")
    two = dataclasses.replace(MODEL, arch={**MODEL.arch, "num_labels": 2})
    with pytest.raises(ValueError, match="arch.num_labels=1"):
        warm_start_scorer(two, DATA, "/nonexistent", dataclasses.replace(RECIPE, steps=1))
