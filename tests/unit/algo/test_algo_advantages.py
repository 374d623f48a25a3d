"""Advantage estimators: hand-computed cases, slow references, Part 1 edge cases."""

import algo_slow_reference as ref
import pytest
import torch

from relax_hpc.algo import advantages as adv
from relax_hpc.algo.aggregation import masked_whiten

SEEDS = [0, 1, 2]


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(
        actual.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )


# ---------------------------------------------------------------- hand-computed


def test_grpo_hand_computed():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0])
    mask = torch.tensor([[1, 1], [1, 0], [0, 1], [1, 1], [1, 1]])
    groups = torch.tensor([0, 0, 0, 1, 1])
    a = 1 / (1 + 1e-6)  # mean 2, unbiased std 1
    close(
        adv.grpo_advantages(scores, mask, groups),
        [[-a, -a], [0, 0], [0, a], [0, 0], [0, 0]],
    )


def test_dr_grpo_and_rloo_hand_computed():
    scores = torch.tensor([1.0, 2.0, 3.0])
    mask = torch.ones(3, 1)
    groups = torch.zeros(3, dtype=torch.long)
    close(adv.dr_grpo_advantages(scores, mask, groups), [[-1.0], [0.0], [1.0]])
    close(adv.rloo_advantages(scores, mask, groups), [[-1.5], [0.0], [1.5]])


def test_reinforce_pp_baseline_hand_computed():
    scores = torch.tensor([1.0, 3.0, 0.0, 0.0])
    mask = torch.ones(4, 1)
    groups = torch.tensor([0, 0, 1, 1])
    # centred [-1, 1, 0, 0]; population variance 0.5
    s = 2**0.5
    close(adv.reinforce_pp_baseline_advantages(scores, mask, groups), [[-s], [s], [0], [0]])


def test_discounted_returns_continue_through_masked_tokens():
    rewards = torch.tensor([[0.0, 7.0, 1.0]])  # the masked 7.0 must not count
    mask = torch.tensor([[1, 0, 1]])
    close(adv.discounted_returns(rewards, mask, gamma=0.5), [[0.25, 0.0, 1.0]])


def test_gae_hand_computed_skips_masked_positions():
    rewards = torch.tensor([[0.0, float("nan"), 1.0]])
    values = torch.tensor([[0.5, float("nan"), 0.2]])
    mask = torch.tensor([[1, 0, 1]])
    advantages, returns = adv.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    # t=2: delta = 1 - 0.2 = 0.8; t=0: delta = 0 + 0.2 - 0.5 = -0.3, A = -0.3 + 0.8
    close(advantages, [[0.5, 0.0, 0.8]])
    close(returns, [[1.0, 0.0, 1.0]])


def test_gae_hand_computed_with_discount():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2]])
    advantages, _ = adv.gae_advantages(rewards, values, torch.ones(1, 2), gamma=0.9, lam=0.5)
    delta1 = 1 - 0.2
    delta0 = 0.9 * 0.2 - 0.5
    close(advantages, [[delta0 + 0.9 * 0.5 * delta1, delta1]])


def test_outcome_token_rewards_puts_score_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]])
    kl = torch.full((2, 5), 0.1)
    close(
        adv.outcome_token_rewards(torch.tensor([2.0, 9.0]), mask, kl),
        [[-0.1, -0.1, 0, 1.9, 0], [0, 0, 0, 0, 0]],
    )


def test_kl_shaped_scores_subtract_summed_penalty():
    mask = torch.tensor([[1, 0, 1]])
    kl = torch.tensor([[0.1, float("nan"), 0.2]])
    close(adv.kl_shaped_scores(torch.tensor([1.0]), mask, kl), [0.7])


# ---------------------------------------------------------------- slow references


@pytest.mark.parametrize("seed", SEEDS)
def test_group_estimators_match_reference(seed):
    b = ref.random_batch(seed, group_size=2 + seed)
    s, m, g = ref.lists(b.scores), ref.lists(b.mask), b.group_ids.tolist()
    close(adv.grpo_advantages(b.scores, b.mask, b.group_ids), ref.grpo(s, m, g))
    close(
        adv.dr_grpo_advantages(b.scores, b.mask, b.group_ids),
        ref.grpo(s, m, g, divide_by_std=False),
    )
    close(adv.rloo_advantages(b.scores, b.mask, b.group_ids), ref.rloo(s, m, g))
    close(
        adv.reinforce_pp_baseline_advantages(b.scores, b.mask, b.group_ids),
        ref.reinforce_pp_baseline(s, m, g),
    )


def failing_third(seed: int, num_samples: int) -> torch.Tensor:
    """A known third of the samples (random, seeded) whose reward failed."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(100 + seed))
    scored = torch.ones(num_samples, dtype=torch.bool)
    scored[order[: num_samples // 3]] = False
    return scored


@pytest.mark.parametrize("seed", SEEDS)
def test_group_estimators_with_failed_rewards_match_reference(seed):
    b = ref.random_batch(seed, num_groups=4, group_size=2 + seed)
    scored = failing_third(seed, len(b.scores))
    scores = torch.where(scored, b.scores, float("nan"))  # a failed score never leaks
    s, m, g = ref.lists(b.scores), ref.lists(b.mask), b.group_ids.tolist()
    flags = scored.tolist()
    args = (scores, b.mask, b.group_ids)
    close(adv.grpo_advantages(*args, scored_B=scored), ref.grpo(s, m, g, scored=flags))
    close(
        adv.dr_grpo_advantages(*args, scored_B=scored),
        ref.grpo(s, m, g, divide_by_std=False, scored=flags),
    )
    close(adv.rloo_advantages(*args, scored_B=scored), ref.rloo(s, m, g, scored=flags))
    close(
        adv.reinforce_pp_baseline_advantages(*args, scored_B=scored),
        ref.reinforce_pp_baseline(s, m, g, scored=flags),
    )
    kept = ref.kept(flags, g)
    assert adv.trained_samples(scored, b.group_ids).tolist() == kept
    short = [
        gid for gid in set(g) if sum(ok for j, ok in zip(g, flags, strict=True) if j == gid) < 2
    ]
    assert adv.num_dropped_groups(scored, b.group_ids) == len(short)


def test_a_group_left_with_one_scored_sample_is_dropped_and_counted():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.2])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    scored = torch.tensor([True, False, False, True, False, True])
    assert adv.trained_samples(scored, groups).tolist() == [False] * 3 + [True, False, True]
    assert adv.num_dropped_groups(scored, groups) == 1
    result = adv.grpo_advantages(scores, torch.ones(6, 2), groups, scored_B=scored)
    close(result[:3], [[0, 0]] * 3)  # no baseline: no advantage, no NaN
    close(result[3:, 0], [1 / (0.8 / 2**0.5 + 1e-6) * 0.4, 0, -0.4 / (0.8 / 2**0.5 + 1e-6)])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference(seed, gamma):
    b = ref.random_batch(seed)
    m = ref.lists(b.mask)
    rewards = ref.token_rewards(ref.lists(b.scores), m, ref.lists(b.values))
    rewards_t = adv.outcome_token_rewards(b.scores, b.mask, b.values)
    close(rewards_t, rewards)
    advantages, returns = adv.reinforce_pp_advantages(rewards_t, b.mask, gamma)
    expected_returns = ref.discounted_returns(rewards, m, gamma)
    close(returns, expected_returns)
    close(advantages, ref.whiten(expected_returns, m))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_reference(seed, gamma, lam):
    b = ref.random_batch(seed)
    m = ref.lists(b.mask)
    rewards_t = adv.outcome_token_rewards(b.scores, b.mask, 0.01 * b.ref_logprobs)
    rewards = ref.lists(rewards_t)
    advantages, returns = adv.gae_advantages(rewards_t, b.values, b.mask, gamma, lam)
    expected_adv, expected_returns = ref.gae(rewards, ref.lists(b.values), m, gamma, lam)
    close(advantages, expected_adv)
    close(returns, expected_returns)
    close(masked_whiten(advantages, b.mask), ref.whiten(expected_adv, m))


# ---------------------------------------------------------------- edge cases (Part 1)


@pytest.mark.parametrize(
    "estimator",
    [
        adv.grpo_advantages,
        adv.dr_grpo_advantages,
        adv.rloo_advantages,
        adv.reinforce_pp_baseline_advantages,
    ],
)
def test_group_of_one_is_rejected(estimator):
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        estimator(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, 2), torch.tensor([0, 0, 1]))


def test_non_finite_reward_is_rejected_with_the_sample():
    with pytest.raises(ValueError, match=r"samples \[1\]"):
        adv.grpo_advantages(torch.tensor([1.0, float("nan")]), torch.ones(2, 2), torch.zeros(2))


def test_empty_response_gets_zero_but_its_score_counts_in_the_group():
    scores = torch.tensor([0.0, 1.0, 2.0])
    mask = torch.tensor([[0, 0], [1, 1], [1, 0]])
    result = adv.dr_grpo_advantages(scores, mask, torch.zeros(3))
    close(result, [[0, 0], [0, 0], [1, 0]])  # mean 1 includes the empty sample's 0


def test_reinforce_pp_empty_response_has_zero_returns():
    mask = torch.tensor([[0, 0, 0], [1, 1, 0]])
    rewards = adv.outcome_token_rewards(torch.tensor([5.0, 1.0]), mask)
    advantages, returns = adv.reinforce_pp_advantages(rewards, mask, 1.0)
    close(returns[0], [0, 0, 0])
    close(advantages[0], [0, 0, 0])


def test_near_zero_std_is_accurate_when_centred_first():
    scores = torch.tensor([0.5, 0.5, 0.5 + 2**-20])
    mask = torch.ones(3, 1)
    expected = ref.grpo([0.5, 0.5, 0.5 + 2**-20], [[1], [1], [1]], [0, 0, 0])
    torch.testing.assert_close(
        adv.grpo_advantages(scores, mask, torch.zeros(3)).double(),
        torch.tensor(expected, dtype=torch.float64),
        rtol=1e-4,
        atol=0,
    )


def test_all_equal_group_gives_zero_not_nan():
    result = adv.grpo_advantages(torch.full((4,), 0.3), torch.ones(4, 3), torch.zeros(4))
    assert torch.equal(result, torch.zeros(4, 3))


def test_whitening_one_valid_token_gives_zero():
    x = torch.tensor([[3.0, float("nan")], [float("nan"), float("nan")]])
    mask = torch.tensor([[1, 0], [0, 0]])
    assert torch.equal(masked_whiten(x, mask), torch.zeros(2, 2))
    assert torch.equal(masked_whiten(x, torch.zeros(2, 2)), torch.zeros(2, 2))
