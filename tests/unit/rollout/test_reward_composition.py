"""Weighted composition of reward parts, per data source, with every part logged apart."""

from __future__ import annotations

import pytest

from relax_hpc.config.rewards import RewardsConfig
from relax_hpc.rollout.rewards.compose import CompositeScorer, Weights
from relax_hpc.rollout.rewards.result import RewardResult, failed
from relax_hpc.rollout.rewards.scorer import RewardScorer, ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_scorer


class LengthJudge:
    """A stand-in service part: the score is 1 when the response is long enough; a response
    "down" fails like an unreachable service. Records what it was asked."""

    def __init__(self, min_length: int = 2) -> None:
        self.min_length = min_length
        self.seen: list[str] = []
        self.closed = False

    def score(self, items):
        self.seen += [item.completion for item in items]
        return [
            failed("judge unreachable")
            if item.completion == "down"
            else RewardResult(float(len(item.completion) >= self.min_length), {"n": 1})
            for item in items
        ]

    def metrics(self):
        return {"requests_total": 3.0}

    def close(self):
        self.closed = True


def items(*rows):
    return [ScoreItem(c, a, m, "p") for c, a, m in rows]


def test_weighted_parts_add_up_and_every_part_is_kept_in_the_details():
    judge = LengthJudge()
    scorer = CompositeScorer(
        {"exact_match": RewardScorer("exact_match", None), "judge": judge},
        Weights({"exact_match": 1.0, "judge": 0.5}),
    )
    results = scorer.score(items(("42", "42", {}), ("4", "42", {}), ("99", "42", {})))
    assert [r.score for r in results] == [1.5, 0.0, 0.5]
    assert results[0].details["parts"] == {"exact_match": 1.0, "judge": 1.0}
    assert results[0].details["judge"] == {"n": 1} and results[0].failed is None
    metrics = scorer.metrics()
    assert metrics["rewards/exact_match/mean"] == pytest.approx(1 / 3)
    assert metrics["rewards/judge/mean"] == pytest.approx(2 / 3)
    assert metrics["rewards/judge/requests_total"] == 3.0  # the service's own totals
    assert metrics["rewards/failed"] == 0.0
    scorer.close()
    assert judge.closed


def test_weights_follow_the_rows_data_source():
    judge = LengthJudge()
    scorer = CompositeScorer(
        {"exact_match": RewardScorer("exact_match", None), "judge": judge},
        Weights(
            {"exact_match": 1.0},
            {"chat": {"judge": 1.0}, "math": {"exact_match": 1.0, "judge": 0.0}},
            "source",
        ),
    )
    rows = items(
        ("42", "42", {"source": "math"}),
        ("long answer", "x", {"source": "chat"}),
        ("42", "42", {"source": "unknown"}),  # -> the default table
        ("42", "42", {}),
    )
    results = scorer.score(rows)
    assert [r.score for r in results] == [1.0, 1.0, 1.0, 1.0]
    assert judge.seen == ["42", "long answer"]  # only where a table names it
    assert results[0].details["parts"] == {"exact_match": 1.0, "judge": 1.0}  # weight 0: logged
    assert results[1].details["parts"] == {"judge": 1.0}


def test_a_source_without_weights_and_no_default_is_failed_with_the_reason():
    scorer = CompositeScorer(
        {"judge": LengthJudge()}, Weights({}, {"chat": {"judge": 1.0}}, "source")
    )
    (result,) = scorer.score(items(("abc", "", {"source": "poetry"})))
    assert result.score == 0.0
    assert "data source 'poetry' (column 'source') has no entry" in result.failed


def test_a_failed_part_fails_the_sample_only_when_it_carries_weight():
    scorer = CompositeScorer(
        {"exact_match": RewardScorer("exact_match", None), "judge": LengthJudge()},
        Weights(
            {"exact_match": 1.0, "judge": 0.0},
            {"judged": {"judge": 1.0, "exact_match": 1.0}},
            "src",
        ),
    )
    counted, monitored = scorer.score(
        items(("down", "down", {"src": "judged"}), ("down", "down", {}))
    )
    assert counted.score == 1.0 and counted.failed == "judge: judge unreachable"
    assert counted.details["failed_parts"] == {"judge": "judge unreachable"}
    assert monitored.score == 1.0 and monitored.failed is None  # the judge only monitors here
    assert scorer.metrics()["rewards/failed"] == 1.0
    assert scorer.metrics()["rewards/judge/failed"] == 2.0
    scorer.score(items(("fine", "fine", {})))
    metrics = scorer.metrics()
    assert metrics["rewards/judge/failed"] == 0.0  # the last batch
    assert (metrics["rewards/judge/failed_total"], metrics["rewards/judge/samples_total"]) == (2, 3)


def test_agreement_compares_each_parts_verdict_with_the_reference_part():
    scorer = CompositeScorer(
        {"judge": LengthJudge(), "exact_match": RewardScorer("exact_match", None)},
        Weights({"judge": 1.0}),
        agreement_with="exact_match",
    )
    results = scorer.score(
        items(("42", "42", {}), ("43", "42", {}), ("4", "4", {}), ("5", "42", {}))
    )
    # judge says yes, no-but-right... : agree, disagree, disagree, agree
    assert [r.details["parts"] for r in results][1] == {"judge": 1.0, "exact_match": 0.0}
    assert scorer.metrics()["rewards/agreement/judge"] == 0.5
    assert "rewards/agreement/exact_match" not in scorer.metrics()


def test_a_single_part_passes_its_result_through_unchanged():
    scorer = CompositeScorer({"math": RewardScorer("math", None)}, Weights({"math": 1.0}))
    (result,) = scorer.score([("so \\boxed{4}", "4", {})])
    assert result == RewardResult(1.0, {"extracted": "4"})
    assert scorer.metrics()["rewards/math/mean"] == 1.0


def test_build_scorer_builds_the_parts_a_config_names():
    rewards = RewardsConfig(weights={"exact_match": 1.0, "format": 0.25}, agreement_with="math")
    scorer = build_scorer("composite", rewards, None, RewardContext(reward_timeout_s=None))
    assert set(scorer.parts) == {"exact_match", "format", "math"}
    (result,) = scorer.score([("Answer: 7", "Answer: 7", {})])
    assert result.score == 1.25
    assert result.details["parts"] == {"exact_match": 1.0, "format": 1.0, "math": 0.0}
    with pytest.raises(ValueError, match="'judge' needs a judge"):
        build_scorer("judge", RewardsConfig(), None, RewardContext())
