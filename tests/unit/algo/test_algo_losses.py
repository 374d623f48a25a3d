"""Per-token losses, KL estimators, TIS, distillation, entropy and aggregation."""

import math

import algo_slow_reference as ref
import pytest
import torch

from relax_hpc.algo import distillation, kl, losses, tis
from relax_hpc.algo.aggregation import aggregate

SEEDS = [0, 1, 2]
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KL_TYPES = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+"]


def close(actual: torch.Tensor, expected, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        actual.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=rtol, atol=atol
    )


def one_token(x: float) -> torch.Tensor:
    return torch.tensor([[x]])


ONE = torch.ones(1, 1)


# ---------------------------------------------------------------- hand-computed


def test_ppo_clip_hand_computed():
    log2 = math.log(2.0)
    # A > 0, ratio 2 clipped at 1.2; A < 0, ratio 2 -> unclipped 2, dual-clip caps at 3 * 1
    loss, m = losses.ppo_clip_loss(one_token(log2), one_token(0.0), one_token(1.0), ONE)
    close(loss, [[-1.2]])
    assert m["pg_clipfrac"] == 1.0
    loss, m = losses.ppo_clip_loss(one_token(log2), one_token(0.0), one_token(-1.0), ONE)
    close(loss, [[2.0]])
    loss, m = losses.ppo_clip_loss(one_token(math.log(5.0)), one_token(0.0), one_token(-1.0), ONE)
    close(loss, [[3.0]])
    assert m["pg_clipfrac_lower"] == 1.0
    loss, _ = losses.ppo_clip_loss(
        one_token(math.log(5.0)), one_token(0.0), one_token(-1.0), ONE, dual_clip_c=None
    )
    close(loss, [[5.0]])
    loss, _ = losses.ppo_clip_loss(
        one_token(math.log(1.25)), one_token(0.0), one_token(1.0), ONE, clip_high=0.28
    )
    close(loss, [[-1.25]])


def test_ppo_clip_rejects_dual_clip_c_at_most_one():
    with pytest.raises(ValueError, match="dual_clip_c"):
        losses.ppo_clip_loss(ONE, ONE, ONE, ONE, dual_clip_c=1.0)


def test_gspo_uses_geometric_mean_of_token_ratios():
    logprobs = torch.tensor([[math.log(2.0), math.log(0.5), 0.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, _ = losses.gspo_loss(
        logprobs, torch.zeros(1, 4), torch.ones(1, 4), mask, clip_low=0.2, clip_high=0.2
    )
    close(loss, [[-1.0, -1.0, -1.0, 0.0]])  # geometric mean of 2, 0.5, 1 is 1


def test_sapo_hand_computed():
    loss, _ = losses.sapo_loss(one_token(0.0), one_token(0.0), one_token(1.0), ONE)
    close(loss, [[-2.0]])  # gate 4/tau * sigmoid(0) = 2 at tau = 1
    loss, _ = losses.sapo_loss(one_token(math.log(2.0)), one_token(0.0), one_token(-1.0), ONE)
    close(loss, [[4 / 1.05 / (1 + math.exp(-1.05))]])


def test_cispo_hand_computed():
    loss, m = losses.cispo_loss(one_token(math.log(8.0)), one_token(0.0), one_token(2.0), ONE)
    close(loss, [[-5.0 * 2.0 * math.log(8.0)]])  # weight clipped at 1 + 4
    assert m["pg_clipfrac"] == 1.0
    loss, _ = losses.cispo_loss(one_token(-1.0), one_token(0.0), one_token(-1.0), ONE, 0.2, 0.28)
    close(loss, [[0.8 * -1.0]])  # weight exp(-1) raised to 0.8; -0.8 * (-1) * (-1)


def test_reinforce_loss_hand_computed():
    loss, _ = losses.reinforce_loss(one_token(-0.5), one_token(0.0), one_token(2.0), ONE)
    close(loss, [[1.0]])


def test_m2po_no_harmful_tokens_means_no_constraint():
    low, high, metrics = losses.m2po_clip_margins(
        one_token(0.5), one_token(-1.0), ONE, budget=0.01, min_clip_low=0.3, min_clip_high=0.5
    )
    assert (low, high) == (1.0, 1e5 - 1)
    assert metrics["m2po_m2_before"] == 0.0


def test_m2po_water_filling_hand_computed():
    # harmful log-ratios 0.1, 0.2, 1.0 -> squares 0.01, 0.04, 1.0; mean 0.35 > budget 0.05.
    # n * budget = 0.15; k = 1: 0.04 * 1 + 0.05 < 0.15; k = 2: 0 + 1.05 >= 0.15
    # -> cap at d_1 = 0.04 (tau = 0.2), M2 after = (0.04 * 1 + 0.05) / 3.
    log_ratio = torch.tensor([[0.1, 0.2, 1.0]])
    low, high, metrics = losses.m2po_clip_margins(
        log_ratio, torch.ones(1, 3), torch.ones(1, 3), 0.05, min_clip_low=0.0, min_clip_high=0.0
    )
    tau = math.sqrt(0.04 - 1e-12)
    assert low == pytest.approx(1 - math.exp(-tau))
    assert high == pytest.approx(math.exp(tau) - 1)
    assert metrics["m2po_m2_after"].item() == pytest.approx(0.03)
    low, high, _ = losses.m2po_clip_margins(
        log_ratio, torch.ones(1, 3), torch.ones(1, 3), 0.05, 0.3, 0.5
    )
    assert (low, high) == (0.3, 0.5)  # floors win


def test_m2po_ignores_masked_tokens():
    log_ratio = torch.tensor([[0.05, 5.0]])
    _, _, metrics = losses.m2po_clip_margins(
        log_ratio, torch.ones(1, 2), torch.tensor([[1, 0]]), 0.01, 0.3, 0.5
    )
    assert metrics["m2po_m2_before"].item() == pytest.approx(0.0025)


def test_value_loss_hand_computed():
    loss, m = losses.clipped_value_loss(one_token(2.0), one_token(0.0), one_token(0.0), ONE)
    close(loss, [[0.5 * 4.0]])  # clipped 0.5 is closer to R, the max keeps 4
    loss, m = losses.clipped_value_loss(one_token(2.0), one_token(0.0), one_token(3.0), ONE)
    close(loss, [[0.5 * 2.5**2]])
    assert m["vf_clipfrac"] == 1.0


def test_entropy_of_uniform_and_peaked_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    close(losses.entropy_from_logits(logits), [[math.log(4.0), 0.0]], atol=1e-5)


@pytest.mark.parametrize(
    ("kl_type", "expected"),
    [("k1", 0.5), ("abs", 0.5), ("k2", 0.125), ("k3", math.exp(-0.5) - 1 + 0.5)],
)
def test_kl_estimators_hand_computed(kl_type, expected):
    close(kl.kl_penalty(one_token(0.0), one_token(-0.5), ONE, kl_type), [[expected]])


def test_k3_clamps_outliers():
    close(kl.kl_penalty(one_token(-30.0), one_token(0.0), ONE, "k3"), [[10.0]])


@pytest.mark.parametrize(("kl_type", "base"), [("k1+", "k1"), ("k3+", "k3")])
def test_straight_through_kl_has_base_value_and_k2_gradient(kl_type, base):
    logprobs = torch.tensor([[-0.3, -1.0]], requires_grad=True)
    ref_logprobs = torch.tensor([[-1.0, -0.2]])
    value = kl.kl_penalty(logprobs, ref_logprobs, torch.ones(1, 2), kl_type)
    close(value, kl.kl_penalty(logprobs, ref_logprobs, torch.ones(1, 2), base))
    value.sum().backward()
    close(logprobs.grad, logprobs.detach() - ref_logprobs)


def test_unknown_kl_type_is_rejected():
    with pytest.raises(ValueError, match="unknown kl_type"):
        kl.kl_penalty(ONE, ONE, ONE, "abs+")


def test_tis_hand_computed():
    old = torch.tensor([[math.log(3.0), 0.0, math.log(0.5)]])
    rollout = torch.zeros(1, 3)
    w, m = tis.truncated_is_weights(old, rollout, torch.ones(1, 3), "truncate", cap=2.0)
    close(w, [[2.0, 1.0, 0.5]])
    w, _ = tis.truncated_is_weights(old, rollout, torch.ones(1, 3), "mask", cap=2.0, low=0.6)
    close(w, [[0.0, 1.0, 0.0]])
    w, _ = tis.truncated_is_weights(old, rollout, torch.ones(1, 3), "truncate", "sequence", 2.0)
    close(w, [[1.5, 1.5, 1.5]])  # exp(log 3 + log 0.5)
    close(m["tis_clipfrac"], 1 / 3)


def test_opd_divergences_hand_computed():
    student, teacher = one_token(-0.5), one_token(-1.0)
    close(distillation.opd_divergence(student, teacher, ONE, "reverse_kl"), [[0.5]])
    close(
        distillation.opd_divergence(student, teacher, ONE, "low_var_kl"),
        [[math.exp(-0.5) - 1 + 0.5]],
    )
    close(distillation.opd_divergence(student, teacher, ONE, "reverse_kl", 0.2), [[0.2]])
    shaped = distillation.opd_shaped_advantages(one_token(1.0), student, teacher, ONE, coef=2.0)
    close(shaped, [[0.0]])
    only = distillation.opd_shaped_advantages(
        one_token(1.0), student, teacher, ONE, coef=1.0, only_reward=True
    )
    close(only, [[-0.5]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 6 / 3),
        ("seq-mean-token-sum", 6 / 2),
        ("seq-mean-token-mean", (1.5 + 3) / 2),
        ("seq-mean-token-sum-norm", 6 / 10),
    ],
)
def test_aggregation_hand_computed(mode, expected):
    loss = torch.tensor([[1.0, 2.0, float("nan")], [3.0, float("nan"), 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    close(aggregate(loss, mask, mode, loss_scale_factor=10.0), expected)


def test_sum_norm_requires_constant_and_dp_needs_global_counts():
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregate(ONE, ONE, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="global"):
        aggregate(ONE, ONE, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(ONE, ONE, "sum")


# ---------------------------------------------------------------- slow references


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_kl_matches_reference(seed, kl_type):
    b = ref.random_batch(seed, log_ratio_scale=3.0)
    m, lp, rl = ref.lists(b.mask), ref.lists(b.logprobs), ref.lists(b.ref_logprobs)
    expected = ref.per_token(lambda x, y: ref.kl_value(x, y, kl_type), m, lp, rl)
    close(kl.kl_penalty(b.logprobs, b.ref_logprobs, b.mask, kl_type), expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_matches_reference(seed, mode, level):
    b = ref.random_batch(seed)
    expected = ref.tis_weights(
        ref.lists(b.old_logprobs), ref.lists(b.rollout_logprobs), ref.lists(b.mask),
        mode, level, 2.0, 0.5,
    )  # fmt: skip
    w, _ = tis.truncated_is_weights(
        b.old_logprobs, b.rollout_logprobs, b.mask, mode, level, 2.0, 0.5
    )
    close(w, expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("kind", "clip"), [("reverse_kl", None), ("low_var_kl", 0.3)])
def test_opd_matches_reference(seed, kind, clip):
    b = ref.random_batch(seed)
    m = ref.lists(b.mask)
    expected = ref.per_token(
        lambda s, t: ref.opd_divergence(s, t, kind, clip),
        m, ref.lists(b.logprobs), ref.lists(b.teacher_logprobs),
    )  # fmt: skip
    actual = distillation.opd_divergence(b.logprobs, b.teacher_logprobs, b.mask, kind, clip)
    close(actual, expected)
    shaped = distillation.opd_shaped_advantages(
        b.advantages, b.logprobs, b.teacher_logprobs, b.mask, 0.7, kind, clip
    )
    close(shaped, ref.per_token(lambda a, k: a - 0.7 * k, m, ref.lists(b.advantages), expected))
    loss = distillation.opd_loss_per_token(
        b.logprobs, b.teacher_logprobs, b.old_logprobs, b.mask, kind, clip, is_clip=1.1
    )
    expected_loss = ref.per_token(
        lambda k, lp, old: k * min(ref.ratio(lp, old), 1.1),
        m, expected, ref.lists(b.logprobs), ref.lists(b.old_logprobs),
    )  # fmt: skip
    close(loss, expected_loss)


def _loss_inputs(seed: int, scale: float = 0.3):
    b = ref.random_batch(seed, log_ratio_scale=scale)
    logprobs = b.logprobs.clone().requires_grad_(True)
    lists = [ref.lists(x) for x in (b.mask, b.logprobs, b.old_logprobs, b.advantages)]
    return b, logprobs, lists


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("low", "high", "c"), [(0.2, 0.2, 3.0), (0.2, 0.28, None)])
def test_ppo_clip_matches_reference_with_gradient(seed, low, high, c):
    b, logprobs, (m, lp, old, a) = _loss_inputs(seed, scale=0.5)
    loss, _ = losses.ppo_clip_loss(logprobs, b.old_logprobs, b.advantages, b.mask, low, high, c)
    close(loss, ref.per_token(lambda *x: ref.ppo_token(*x, low, high, c), m, lp, old, a))
    loss.sum().backward()
    expected_grad = ref.per_token(lambda *x: ref.ppo_token_grad(*x, low, high, c), m, lp, old, a)
    close(logprobs.grad, expected_grad)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_matches_reference(seed):
    b, logprobs, (m, lp, old, a) = _loss_inputs(seed, scale=0.01)
    loss, _ = losses.gspo_loss(logprobs, b.old_logprobs, b.advantages, b.mask, 3e-4, 4e-4)
    close(loss, ref.gspo(lp, old, a, m, 3e-4, 4e-4))


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_cispo_reinforce_match_reference(seed):
    b, logprobs, (m, lp, old, a) = _loss_inputs(seed, scale=1.0)
    args = (logprobs, b.old_logprobs, b.advantages, b.mask)
    close(
        losses.sapo_loss(*args, 1.0, 1.05)[0],
        ref.per_token(lambda *x: ref.sapo_token(*x, 1.0, 1.05), m, lp, old, a),
    )
    close(
        losses.cispo_loss(*args, 0.2, 0.28)[0],
        ref.per_token(lambda *x: ref.cispo_token(*x, 0.2, 0.28), m, lp, old, a),
    )
    close(losses.reinforce_loss(*args)[0], ref.per_token(lambda p, o, x: -x * p, m, lp, old, a))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("budget", [0.001, 0.01, 10.0])
def test_m2po_matches_reference(seed, budget):
    b, logprobs, (m, lp, old, a) = _loss_inputs(seed, scale=0.5)
    loss, metrics = losses.m2po_loss(
        logprobs, b.old_logprobs, b.advantages, b.mask, budget, 0.01, 0.02
    )
    low, high, before, after = ref.m2po_margins(lp, old, a, m, budget, 0.01, 0.02)
    close(metrics["m2po_clip_low"], low)
    close(metrics["m2po_clip_high"], high)
    close(metrics["m2po_m2_before"], before)
    close(metrics["m2po_m2_after"], after)
    close(loss, ref.per_token(lambda *x: ref.ppo_token(*x, low, high, None), m, lp, old, a))


@pytest.mark.parametrize("seed", SEEDS)
def test_value_loss_matches_reference(seed):
    b = ref.random_batch(seed)
    loss, _ = losses.clipped_value_loss(b.values, b.old_values, b.returns, b.mask, 0.5)
    expected = ref.per_token(
        lambda v, o, r: ref.value_token(v, o, r, 0.5),
        ref.lists(b.mask), ref.lists(b.values), ref.lists(b.old_values), ref.lists(b.returns),
    )  # fmt: skip
    close(loss, expected)


def test_entropy_matches_reference():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0)) * 3
    expected = [[ref.entropy(row) for row in sample] for sample in logits.double().tolist()]
    close(losses.entropy_from_logits(logits), expected)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_reference(seed, mode):
    b = ref.random_batch(seed)
    expected = ref.aggregate(ref.lists(b.advantages), ref.lists(b.mask), mode, 7.0)
    close(aggregate(b.advantages, b.mask, mode, loss_scale_factor=7.0), expected)
