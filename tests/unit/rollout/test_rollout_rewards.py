"""The reward registry, the module:function extension point, and fault-tolerant scoring."""

from __future__ import annotations

import time

import pytest
from rollout_reward_fixtures import raising_reward

from relax_hpc.data.datasets import PromptRecord
from relax_hpc.rollout.rewards import (
    RewardResult,
    RewardScorer,
    build_reward,
    call_reward,
    exact_match,
    final_answer,
    format_reward,
    math_reward,
    resolve_reward,
)


def test_exact_match_ignores_surrounding_whitespace_only():
    assert exact_match(" 58\n", "58", {}).score == 1.0
    assert exact_match("5 8", "58", {}).score == 0.0


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("first \\boxed{3}, on reflection \\boxed{4}", "4", 1.0),
        ("first \\boxed{3}, on reflection \\boxed{4}", "3", 0.0),
        ("The area is \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("Thinking...\nAnswer: 42", "42", 1.0),
        ("I do not know.", "42", 0.0),
    ],
)
def test_math_reward_verifies_the_final_answer(completion, answer, score):
    assert math_reward(completion, answer, {}).score == score


def test_final_answer_extraction():
    assert final_answer("x \\boxed{\\{1, 2\\}} y") == "\\{1, 2\\}"
    assert final_answer("\\boxed{a{b}c}") == "a{b}c"
    assert final_answer("Answer: 7\nmore text") == "7"
    assert final_answer("no answer here") is None
    assert math_reward("no answer here", "1", {}).details == {"extracted": None}


def test_format_reward():
    assert format_reward("<think>hm</think> \\boxed{1}", "", {}).score == 1.0
    assert format_reward("<think>hm \\boxed{1}", "", {}).score == 0.0
    assert format_reward("just text", "", {}).details == {"has_answer": False, "think_closed": True}


def test_user_reward_from_module_function(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(completion, answer, metadata):\n"
        "    return metadata['weight'] * len(completion)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = RewardScorer("my_rewards:length_bonus", timeout_s=None)
    assert scorer.score([("abc", "", {"weight": 2.0})]) == [RewardResult(6.0)]
    record = PromptRecord("p", [1], "", {"weight": 0.5})
    assert build_reward("my_rewards:length_bonus", timeout_s=None)("abcd", record).score == 2.0


def test_unknown_rewards_are_config_errors():
    with pytest.raises(ValueError, match="rollout.reward: 'exact'"):
        resolve_reward("exact")
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="no function"):
        resolve_reward("math:no_such_function")


def test_raising_or_non_numeric_reward_is_recorded_as_failed():
    result = call_reward(raising_reward, "x", "y", {})
    assert result.score == 0.0
    assert result.failed.startswith("raised RuntimeError: judge unavailable at ")
    assert "non-finite" in call_reward(lambda c, a, m: "oops", "x", "y", {}).failed


def test_timed_out_reward_is_killed_and_the_batch_goes_on():
    with RewardScorer("rollout_reward_fixtures:hanging_reward", timeout_s=1.0) as scorer:
        started = time.monotonic()
        results = scorer.score([("ab", "", {}), ("hang", "", {}), ("abcd", "", {})])
        assert time.monotonic() - started < 30
        assert [r.score for r in results] == [2.0, 0.0, 4.0]
        assert "timed out after 1.0 s" in results[1].failed
        assert results[0].failed is None and results[2].failed is None
    with RewardScorer("rollout_reward_fixtures:raising_reward", timeout_s=5.0) as scorer:
        assert "raised RuntimeError" in scorer.score([("a", "", {})])[0].failed
