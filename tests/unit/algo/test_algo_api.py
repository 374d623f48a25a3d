"""The trainer-facing entry points and the registry, checked against composed references."""

import algo_slow_reference as ref
import pytest
import torch

from relax_hpc.algo import (
    AlgoConfig,
    actor_loss,
    compute_advantages,
    dropped_groups,
    resolve,
    trained_samples,
    value_loss,
)
from relax_hpc.config.algo import ALGORITHM_NAMES

SEEDS = [0, 1]


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(
        actual.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-6
    )


def test_registry_flags():
    flags = {
        name: resolve(AlgoConfig(name=name, loss_scale_factor=100.0, opd_coef=float(name == "opd")))
        for name in ALGORITHM_NAMES
    }
    assert [n for n, s in flags.items() if s.needs_critic] == ["ppo"]
    assert [n for n, s in flags.items() if s.needs_teacher] == ["opd"]
    assert not any(s.needs_reference or s.needs_rollout_logprobs for s in flags.values())
    non_group = {"ppo", "reinforce_pp"}
    assert {n for n, s in flags.items() if not s.group_based} == non_group
    assert flags["gspo"].loss_agg_mode == flags["sapo"].loss_agg_mode == "seq-mean-token-mean"
    assert flags["dr_grpo"].loss_agg_mode == "seq-mean-token-sum-norm"
    assert flags["ppo"].normalize_advantages and not flags["grpo"].normalize_advantages
    only = resolve(AlgoConfig(name="opd", opd_coef=1.0, opd_only_reward=True))
    assert not only.group_based
    assert resolve(AlgoConfig(name="grpo", kl_loss_coef=0.1)).needs_reference


def test_overrides_replace_algorithm_defaults():
    spec = resolve(AlgoConfig(name="grpo", policy_loss="cispo", loss_agg_mode="seq-mean-token-sum"))
    assert spec.config.policy_loss == "cispo"
    assert spec.loss_agg_mode == "seq-mean-token-sum"


def test_resolve_validates():
    with pytest.raises(ValueError, match="algo.name"):
        resolve(AlgoConfig())


# ---------------------------------------------------------------- compute_advantages


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_with_kl_in_reward_folds_kl_into_the_score(seed):
    b = ref.random_batch(seed)
    cfg = AlgoConfig(name="grpo", kl_in_reward_coef=0.1, kl_in_reward_type="k3")
    advantages, returns = compute_advantages(
        cfg, b.scores, b.mask, b.group_ids,
        old_logprobs_BT=b.old_logprobs, ref_logprobs_BT=b.ref_logprobs,
    )  # fmt: skip
    m, old, rl = ref.lists(b.mask), ref.lists(b.old_logprobs), ref.lists(b.ref_logprobs)
    kl = ref.per_token(lambda x, y: 0.1 * ref.kl_value(x, y, "k3"), m, old, rl)
    shaped = [s - sum(row) for s, row in zip(ref.lists(b.scores), kl, strict=True)]
    expected = ref.grpo(shaped, m, b.group_ids.tolist())
    close(advantages, expected)
    close(returns, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("normalize", [True, False])
def test_ppo_gae_with_kl_in_reward_and_whitening(seed, normalize):
    b = ref.random_batch(seed)
    cfg = AlgoConfig(name="ppo", kl_in_reward_coef=0.05, normalize_advantages=normalize)
    advantages, returns = compute_advantages(
        cfg, b.scores, b.mask, values_BT=b.values,
        old_logprobs_BT=b.old_logprobs, ref_logprobs_BT=b.ref_logprobs,
    )  # fmt: skip
    m = ref.lists(b.mask)
    kl = ref.per_token(
        lambda x, y: 0.05 * (x - y), m, ref.lists(b.old_logprobs), ref.lists(b.ref_logprobs)
    )
    rewards = ref.token_rewards(ref.lists(b.scores), m, kl)
    expected_adv, expected_ret = ref.gae(rewards, ref.lists(b.values), m, 1.0, 1.0)
    close(advantages, ref.whiten(expected_adv, m) if normalize else expected_adv)
    close(returns, expected_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_pp_through_the_entry_point(seed):
    b = ref.random_batch(seed)
    cfg = AlgoConfig(name="reinforce_pp", gamma=0.95)
    advantages, returns = compute_advantages(cfg, b.scores, b.mask)
    m = ref.lists(b.mask)
    expected_returns = ref.discounted_returns(ref.token_rewards(ref.lists(b.scores), m), m, 0.95)
    close(returns, expected_returns)
    close(advantages, ref.whiten(expected_returns, m))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("only_reward", [False, True])
def test_opd_advantage_mode(seed, only_reward):
    b = ref.random_batch(seed)
    cfg = AlgoConfig(
        name="opd", opd_coef=0.5, opd_only_reward=only_reward, normalize_advantages=True
    )
    advantages, _ = compute_advantages(
        cfg, b.scores, b.mask, b.group_ids,
        old_logprobs_BT=b.old_logprobs, teacher_logprobs_BT=b.teacher_logprobs,
    )  # fmt: skip
    m = ref.lists(b.mask)
    task = ref.grpo(ref.lists(b.scores), m, b.group_ids.tolist())
    if only_reward:
        task = [[0.0] * len(row) for row in task]
    shaped = ref.per_token(
        lambda a, s, t: a - 0.5 * (s - t),
        m, task, ref.lists(b.old_logprobs), ref.lists(b.teacher_logprobs),
    )  # fmt: skip
    close(advantages, ref.whiten(shaped, m))


def test_missing_inputs_are_named():
    b = ref.random_batch(0)
    with pytest.raises(ValueError, match="values_BT"):
        compute_advantages(AlgoConfig(name="ppo"), b.scores, b.mask)
    with pytest.raises(ValueError, match="group_ids_B"):
        compute_advantages(AlgoConfig(name="rloo"), b.scores, b.mask)
    with pytest.raises(ValueError, match="teacher_logprobs_BT"):
        compute_advantages(
            AlgoConfig(name="opd", opd_coef=1.0), b.scores, b.mask, b.group_ids,
            old_logprobs_BT=b.old_logprobs,
        )  # fmt: skip
    with pytest.raises(ValueError, match="rollout_logprobs_BT"):
        actor_loss(
            AlgoConfig(name="grpo", tis_mode="truncate"),
            b.logprobs, b.old_logprobs, b.advantages, b.mask,
        )  # fmt: skip


# ---------------------------------------------------------------- actor and value loss


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_composite_actor_loss_matches_reference(seed, agg):
    b = ref.random_batch(seed)
    entropy = torch.where(b.mask.bool(), torch.rand(b.mask.shape), float("nan"))
    cfg = AlgoConfig(
        name="grpo", loss_agg_mode=agg, clip_high=0.28, tis_mode="truncate", tis_level="sequence",
        entropy_coef=0.01, kl_loss_coef=0.1, kl_loss_type="k3",
    )  # fmt: skip
    loss, metrics = actor_loss(
        cfg, b.logprobs, b.old_logprobs, b.advantages, b.mask,
        rollout_logprobs_BT=b.rollout_logprobs, ref_logprobs_BT=b.ref_logprobs,
        entropy_BT=entropy,
    )  # fmt: skip
    m, lp, old, a = (ref.lists(x) for x in (b.mask, b.logprobs, b.old_logprobs, b.advantages))
    w = ref.tis_weights(old, ref.lists(b.rollout_logprobs), m, "truncate", "sequence", 2.0, 0.0)
    pg = ref.per_token(lambda *x: ref.ppo_token(*x, 0.2, 0.28, 3.0), m, lp, old, a)
    weighted = ref.per_token(lambda x, y: x * y, m, pg, w)
    kl = ref.per_token(lambda x, y: ref.kl_value(x, y, "k3"), m, lp, ref.lists(b.ref_logprobs))
    expected = (
        ref.aggregate(weighted, m, agg)
        - 0.01 * ref.aggregate(ref.lists(entropy), m, agg)
        + 0.1 * ref.aggregate(kl, m, agg)
    )
    close(loss, expected)
    assert {"pg_loss", "entropy", "kl_loss", "tis_clipfrac", "pg_clipfrac"} <= set(metrics)


@pytest.mark.parametrize("seed", SEEDS)
def test_opd_loss_mode_adds_token_mean_term(seed):
    b = ref.random_batch(seed)
    base = AlgoConfig(name="grpo", loss_agg_mode="seq-mean-token-sum")
    opd = AlgoConfig(
        name="grpo", loss_agg_mode="seq-mean-token-sum", opd_coef=0.3, opd_mode="loss",
        opd_kl_type="low_var_kl", opd_is_clip=1.5,
    )  # fmt: skip
    args = (b.logprobs, b.old_logprobs, b.advantages, b.mask)
    base_loss, _ = actor_loss(base, *args)
    opd_loss, _ = actor_loss(opd, *args, teacher_logprobs_BT=b.teacher_logprobs)
    m, lp, old = ref.lists(b.mask), ref.lists(b.logprobs), ref.lists(b.old_logprobs)
    term = ref.per_token(
        lambda s, t, o: ref.opd_divergence(s, t, "low_var_kl") * min(ref.ratio(s, o), 1.5),
        m, lp, ref.lists(b.teacher_logprobs), old,
    )  # fmt: skip
    close(opd_loss - base_loss, 0.3 * ref.aggregate(term, m, "token-mean"))


def test_use_rollout_logprobs_takes_them_as_old_policy():
    b = ref.random_batch(3)
    cfg = AlgoConfig(name="grpo", use_rollout_logprobs=True)
    via_rollout, _ = actor_loss(
        cfg, b.logprobs, None, b.advantages, b.mask, rollout_logprobs_BT=b.rollout_logprobs
    )
    direct, _ = actor_loss(
        AlgoConfig(name="grpo"), b.logprobs, b.rollout_logprobs, b.advantages, b.mask
    )
    close(via_rollout, direct.detach())


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_every_algorithm_runs_end_to_end(name):
    b = ref.random_batch(4)
    cfg = AlgoConfig(name=name, loss_scale_factor=9.0, opd_coef=float(name == "opd"))
    advantages, returns = compute_advantages(
        cfg, b.scores, b.mask, b.group_ids, values_BT=b.values,
        old_logprobs_BT=b.old_logprobs, teacher_logprobs_BT=b.teacher_logprobs,
    )  # fmt: skip
    logprobs = b.logprobs.clone().requires_grad_(True)
    loss, metrics = actor_loss(cfg, logprobs, b.old_logprobs, advantages, b.mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    assert torch.equal(
        logprobs.grad[~b.mask.bool()], torch.zeros_like(logprobs.grad[~b.mask.bool()])
    )


def failing_third(num_samples: int) -> torch.Tensor:
    scored = torch.ones(num_samples, dtype=torch.bool)
    scored[torch.randperm(num_samples, generator=torch.Generator().manual_seed(7))[::3]] = False
    return scored


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_samples_whose_reward_failed_carry_no_gradient(name):
    b = ref.random_batch(4, num_groups=4, group_size=3)
    scored = failing_third(len(b.scores))
    scores = torch.where(scored, b.scores, float("nan"))  # whatever a failed reward left
    cfg = AlgoConfig(name=name, loss_scale_factor=9.0, opd_coef=float(name == "opd"))
    advantages, _ = compute_advantages(
        cfg, scores, b.mask, b.group_ids, values_BT=b.values,
        old_logprobs_BT=b.old_logprobs, teacher_logprobs_BT=b.teacher_logprobs, scored_B=scored,
    )  # fmt: skip
    trained = trained_samples(cfg, scored, b.group_ids)
    assert not trained[~scored].any() and torch.isfinite(advantages).all()
    assert not advantages[~trained].any()
    logprobs = b.logprobs.clone().requires_grad_(True)
    mask = b.mask * trained[:, None]  # what the trainer trains on
    loss, _ = actor_loss(cfg, logprobs, b.old_logprobs, advantages, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert not logprobs.grad[~trained].any()  # the failed third: no gradient at all
    assert logprobs.grad[trained].abs().sum() > 0
    group_based = resolve(cfg).group_based
    assert dropped_groups(cfg, scored, b.group_ids) == (
        len(set(b.group_ids[~trained & scored].tolist())) if group_based else 0
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_estimators_leave_failed_rewards_out_of_their_statistics(seed):
    b = ref.random_batch(seed)
    scored = failing_third(len(b.scores))
    m_kept = ref.lists(b.mask * scored[:, None])
    reinforce = AlgoConfig(name="reinforce_pp", gamma=0.95)
    advantages, _ = compute_advantages(reinforce, b.scores, b.mask, scored_B=scored)
    returns = ref.discounted_returns(ref.token_rewards(ref.lists(b.scores), m_kept), m_kept, 0.95)
    close(advantages, ref.whiten(returns, m_kept))
    ppo = AlgoConfig(name="ppo", normalize_advantages=True)
    advantages, _ = compute_advantages(ppo, b.scores, b.mask, values_BT=b.values, scored_B=scored)
    rewards = ref.token_rewards(ref.lists(b.scores), m_kept)
    expected, _ = ref.gae(rewards, ref.lists(b.values), m_kept, 1.0, 1.0)
    close(advantages, ref.whiten(expected, m_kept))


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_reference(seed):
    b = ref.random_batch(seed)
    cfg = AlgoConfig(name="ppo", value_clip=0.2, value_loss_coef=0.5)
    loss, metrics = value_loss(cfg, b.values, b.old_values, b.returns, b.mask)
    m = ref.lists(b.mask)
    per_token = ref.per_token(
        lambda v, o, r: ref.value_token(v, o, r, 0.2),
        m, ref.lists(b.values), ref.lists(b.old_values), ref.lists(b.returns),
    )  # fmt: skip
    close(loss, 0.5 * ref.aggregate(per_token, m, "token-mean"))
    assert "vf_clipfrac" in metrics
