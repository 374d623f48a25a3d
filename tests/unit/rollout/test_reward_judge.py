"""The judge on the rollout's engines: a real tiny model, batched greedy verdicts, failures kept."""

from __future__ import annotations

import pytest
from reward_fixtures import TINY_ARCH, train_yes_judge

from relax_hpc.config.schema import JudgeConfig, ModelConfig
from relax_hpc.models.build import build_causal_lm
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.rollout.engines.base import Engine
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.rollout.rewards.judge import JudgeScorer
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_judge_scorer
from relax_hpc.rollout.rewards.verdicts import parse_yes_no, template_text

ARCH = TINY_ARCH
MODEL = ModelConfig(name="judge", tokenizer="char", arch=ARCH)
TEMPLATE = template_text("addition_verifier")


@pytest.fixture(scope="module")
def yes_judge():
    model, tokenizer = train_yes_judge()
    return TransformersEngine(model, tokenizer), tokenizer


def rows(*completions):
    return [ScoreItem(c, "", {}, "12+30=") for c in completions]


def test_a_judge_that_answers_yes_scores_1_in_batches(yes_judge):
    engine, tokenizer = yes_judge
    judge = JudgeScorer(engine, tokenizer, TEMPLATE, parse_yes_no, max_new_tokens=4, batch_size=2)
    results = judge.score(rows("24", "42", "7", "24", "4"))
    assert [r.score for r in results] == [1.0] * 5
    assert results[0].details == {"verdict": "yes", "judge_answer": "yes"}
    assert judge.num_calls == 2  # four distinct judge prompts in batches of two


def test_an_untrained_judge_babbles_and_its_samples_are_failed_with_the_answer():
    tokenizer = build_char_tokenizer()
    engine = TransformersEngine(build_causal_lm(MODEL, tokenizer, seed=3), tokenizer)
    judge = JudgeScorer(engine, tokenizer, TEMPLATE, parse_yes_no, max_new_tokens=6)
    results = judge.score(rows("24", "42"))
    for result in results:
        assert result.score == 0.0
        assert result.failed.startswith("the judge's answer has no yes/no verdict: ")
        assert result.details["judge_answer"] in result.failed.replace("'", "")


def test_rows_the_judge_cannot_read_fail_alone_and_the_rest_is_judged(yes_judge):
    engine, tokenizer = yes_judge
    judge = JudgeScorer(
        engine, tokenizer, "{difficulty}: " + TEMPLATE, parse_yes_no, 4, max_prompt_tokens=20
    )
    items = [
        ScoreItem("3", "", {"difficulty": "easy"}, "1+2="),
        ScoreItem("3", "", {}, "1+2="),  # no such column
        ScoreItem("9" * 30, "", {"difficulty": "easy"}, "1+2="),  # too long for the judge
    ]
    ok, missing, long = judge.score(items)
    assert ok.failed is None
    assert "needs {difficulty}" in missing.failed
    assert "more than the judge's context allows (20)" in long.failed


class CrashingEngine(Engine):
    """Stands in for an engine that dies mid-batch (a CUDA error cannot be caused on CPU)."""

    def generate(self, requests, params):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def load_state_dict(self, named_tensors, policy_version):
        raise AssertionError("a judge's weights are never synced")


def test_an_engine_that_raises_fails_its_batch_not_the_caller():
    judge = JudgeScorer(CrashingEngine(), build_char_tokenizer(), TEMPLATE, parse_yes_no)
    results = judge.score(rows("1", "2"))
    assert [r.failed for r in results] == [
        "the judge's engine raised RuntimeError: CUDA error: an illegal memory access was "
        "encountered"
    ] * 2


def test_build_judge_scorer_runs_the_configured_model_on_the_rollouts_device():
    config = JudgeConfig(
        model=MODEL, template="addition_verifier", apply_chat_template=False, max_new_tokens=3
    )
    judge = build_judge_scorer(config, RewardContext(device="cpu", seed=0))
    assert isinstance(judge, JudgeScorer) and isinstance(judge.engine, TransformersEngine)
    assert not any(p.requires_grad for p in judge.engine.model.parameters())  # frozen
    assert judge.max_prompt_tokens == ARCH["max_position_embeddings"] - 3
    assert len(judge.score(rows("5", "6"))) == 2
