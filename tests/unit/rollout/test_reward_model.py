"""A sequence-classification reward model from a local folder: a tiny one built from config,
saved with transformers, loaded back, and scoring what transformers itself computes."""

from __future__ import annotations

import pytest
import torch
import transformers
from reward_fixtures import save_tiny_reward_model

from relax_hpc.config import ConfigError
from relax_hpc.config.rewards import RewardModelConfig, RewardsConfig
from relax_hpc.rollout.rewards.reward_model import RewardModelScorer, load_reward_model
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_scorer


@pytest.fixture(scope="module")
def rm_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rm") / "tiny-rm"
    save_tiny_reward_model(folder, num_labels=2)
    return folder


ITEMS = [
    ScoreItem("a short answer", "", {}, "Q1: "),
    ScoreItem("a much longer and more careful answer", "", {}, "Q2: "),
    ScoreItem("x", "", {}, "Q3: "),
]


def reference_logits(folder, texts, label):
    """What transformers computes for each text alone (no padding involved)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        return [
            model(**tokenizer(text, return_tensors="pt")).logits[0, label].item() for text in texts
        ]


def test_scores_are_the_models_logits_whatever_the_batching(rm_folder):
    model, tokenizer = load_reward_model(str(rm_folder), "rewards.reward_models.rm.path", label=1)
    scorer = RewardModelScorer(model, tokenizer, "{prompt}{response}", label=1, batch_size=2)
    results = scorer.score(ITEMS)
    expected = reference_logits(rm_folder, [i.prompt + i.completion for i in ITEMS], 1)
    assert [r.score for r in results] == pytest.approx(expected, abs=1e-5)
    assert results[0].details == {"logit": pytest.approx(expected[0], abs=1e-5)}
    squashed = RewardModelScorer(model, tokenizer, label=1, normalize="sigmoid").score(ITEMS)
    assert [r.score for r in squashed] == pytest.approx(
        [torch.sigmoid(torch.tensor(x)).item() for x in expected], abs=1e-5
    )


def test_long_texts_keep_their_end_and_bad_rows_fail_alone(rm_folder):
    model, tokenizer = load_reward_model(str(rm_folder), "rm", label=0)
    scorer = RewardModelScorer(model, tokenizer, "{topic} {prompt}{response}", max_length=8)
    ok, missing = scorer.score(
        [ScoreItem("the end", "", {"topic": "t" * 50}, "p"), ScoreItem("r", "", {}, "p")]
    )
    assert ok.failed is None
    (tail,) = reference_logits(rm_folder, [" the end"[-7:]], 0)  # <bos> + last 7 characters
    assert ok.score == pytest.approx(tail, abs=1e-5)
    assert "the reward model template needs {topic}" in missing.failed


def test_a_folder_without_the_label_or_a_score_head_is_a_config_error(rm_folder, tmp_path):
    with pytest.raises(ConfigError, match="no logit 2"):
        load_reward_model(str(rm_folder), "rewards.reward_models.rm.path", label=2)
    with pytest.raises(ConfigError, match=r"rewards\.reward_models\.rm\.path"):
        load_reward_model(str(tmp_path), "rewards.reward_models.rm.path", label=0)


def test_a_reward_model_is_a_part_by_its_name(rm_folder):
    rewards = RewardsConfig(
        weights={"helpful": 0.5, "exact_match": 1.0},
        reward_models={"helpful": RewardModelConfig(path=str(rm_folder))},
    )
    scorer = build_scorer("composite", rewards, None, RewardContext(reward_timeout_s=None))
    (result,) = scorer.score([ScoreItem("4", "4", {}, "2+2=")])
    (logit,) = reference_logits(rm_folder, ["2+2=4"], 0)
    assert result.score == pytest.approx(1.0 + 0.5 * logit, abs=1e-5)
    assert result.details["parts"]["helpful"] == pytest.approx(logit, abs=1e-5)


ARCH = {
    "num_labels": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
}


def test_a_reward_model_built_from_config_scores_its_own_logits():
    rm = RewardModelConfig(path=None, arch=ARCH, tokenizer="char")
    rm.validate("rm")
    rewards = RewardsConfig(reward_models={"rm": rm})
    first = build_scorer("rm", rewards, None, RewardContext(reward_timeout_s=None, seed=3))
    again = build_scorer("rm", rewards, None, RewardContext(reward_timeout_s=None, seed=3))
    other = build_scorer("rm", rewards, None, RewardContext(reward_timeout_s=None, seed=4))
    items = [ScoreItem("58", "58", {}, "37+48="), ScoreItem("7", "58", {}, "37+48=")]
    scores = [r.score for r in first.score(items)]
    assert scores[0] != scores[1]  # the text reaches the head
    assert scores == [r.score for r in again.score(items)]  # weights drawn from the run's seed
    assert scores != [r.score for r in other.score(items)]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"path": None}, r"rm\.arch: a reward model with path null is built from arch"),
        ({"path": "/models/rm", "warm_start": "addition_scorer"}, r"rm\.path: warm_start="),
        ({"path": None, "arch": ARCH, "label": 1}, r"rm\.label 1 is not a logit"),
        ({"path": None, "arch": ARCH, "tokenizer": "auto"}, r"rm\.tokenizer: 'auto'"),
        ({"path": None, "arch": ARCH, "warm_start": "vibes"}, r"rm\.warm_start 'vibes'"),
    ],
)
def test_a_reward_model_source_that_cannot_work_is_named(fields, message):
    with pytest.raises(ValueError, match=message):
        RewardModelConfig(**fields).validate("rm")
