"""Scoring for the rollout loop: ``rollout.reward``'s parts over (completion, record) pairs.

``make_scorers`` builds the training scorer and the held-out eval's; the parts themselves
(rule rewards, judge, reward models, endpoints) come from ``rewards/services.py``.

Must not: generate or write shards.
"""

from __future__ import annotations

import dataclasses

import torch

from relax_hpc.config import RunConfig
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.rewards.compose import CompositeScorer
from relax_hpc.rollout.rewards.scorer import ScoreItem
from relax_hpc.rollout.rewards.services import RewardContext, build_scorer


class SampleScorer:
    """Scores a batch of (completion, record) pairs with ``rollout.reward``'s parts."""

    def __init__(self, scorer: CompositeScorer) -> None:
        self.scorer = scorer

    def __call__(self, pairs) -> list[tuple[float, dict]]:
        items = [ScoreItem(c.text, r.answer, r.metadata, r.prompt) for c, r in pairs]
        scored = []
        for result in self.scorer.score(items):
            details = dict(result.details)
            if result.failed:  # Sample.reward_failed: trained with no loss weight
                details["failed"] = result.failed
                details["reward_failed"] = True
            scored.append((result.score, details))
        return scored

    def metrics(self) -> dict[str, float]:
        return self.scorer.metrics()

    def close(self) -> None:
        self.scorer.close()


def make_scorer(
    cfg: RunConfig, paths: RunPaths, device: torch.device, reward: str | None = None
) -> SampleScorer:
    """``reward`` (default ``rollout.reward``) with the judge, reward models and endpoints it
    names, on this worker's device (``rollout/rewards/services.py``)."""
    rewards = cfg.rewards
    if reward is not None:  # the held-out eval's own reward: no monitors
        rewards = dataclasses.replace(rewards, agreement_with=None)
    context = RewardContext(
        paths=paths,
        device=device,
        data=cfg.data,
        reward_timeout_s=cfg.rollout.reward_timeout_s,
        seed=cfg.seed,
    )
    return SampleScorer(build_scorer(reward or cfg.rollout.reward, rewards, cfg.judge, context))


def make_scorers(
    cfg: RunConfig, paths: RunPaths, device: torch.device
) -> tuple[SampleScorer, SampleScorer]:
    """The training scorer and the held-out eval's (the same one unless
    ``rewards.eval_reward`` names another reward)."""
    score = make_scorer(cfg, paths, device)
    eval_reward = cfg.rewards.eval_reward
    own_eval = eval_reward not in (None, cfg.rollout.reward)
    return score, make_scorer(cfg, paths, device, eval_reward) if own_eval else score


def close_scorers(*scorers: SampleScorer) -> None:
    for scorer in {id(s): s for s in scorers}.values():
        scorer.close()
