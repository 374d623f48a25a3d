"""Property tests (hypothesis): invariants every algorithm must keep on any ragged batch."""

import algo_slow_reference as ref
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relax_hpc.algo import AlgoConfig, actor_loss, compute_advantages, losses, resolve
from relax_hpc.algo.aggregation import aggregate
from relax_hpc.config.algo import ALGORITHM_NAMES, LOSS_AGG_MODES

SETTINGS = settings(max_examples=25, deadline=None)
seeds = st.integers(0, 2**31 - 1)
agg_modes = st.sampled_from(LOSS_AGG_MODES)


def config(name: str, **overrides) -> AlgoConfig:
    return AlgoConfig(name=name, loss_scale_factor=16.0, opd_coef=float(name == "opd"), **overrides)


def advantages_for(cfg: AlgoConfig, b: ref.Batch) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_advantages(
        cfg, b.scores, b.mask, b.group_ids, values_BT=b.values,
        old_logprobs_BT=b.old_logprobs, teacher_logprobs_BT=b.teacher_logprobs,
    )  # fmt: skip


def loss_and_grad(cfg: AlgoConfig, b: ref.Batch, **counts) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = b.logprobs.clone().requires_grad_(True)
    loss, _ = actor_loss(
        cfg, logprobs, b.old_logprobs, b.advantages, b.mask,
        rollout_logprobs_BT=b.rollout_logprobs, ref_logprobs_BT=b.ref_logprobs, **counts,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), logprobs.grad


@SETTINGS
@given(
    name=st.sampled_from(["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"]),
    num_groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    reward=st.floats(-100, 100),
    seed=seeds,
)
def test_all_equal_rewards_give_zero_advantages(name, num_groups, group_size, reward, seed):
    b = ref.random_batch(seed, num_groups, group_size)
    advantages, _ = compute_advantages(
        config(name), torch.full_like(b.scores, reward), b.mask, b.group_ids
    )
    assert torch.equal(advantages, torch.zeros_like(advantages))


@SETTINGS
@given(name=st.sampled_from(ALGORITHM_NAMES), extra=st.integers(1, 5), seed=seeds)
def test_advantages_and_loss_invariant_to_extra_right_padding(name, extra, seed):
    b = ref.random_batch(seed)
    padded = ref.Batch(
        **{
            k: torch.cat([v, torch.full((v.shape[0], extra), float("nan"))], dim=1)
            if v.dim() == 2
            else v
            for k, v in vars(b).items()
        }
    )
    padded.mask = torch.nan_to_num(padded.mask, nan=0.0)
    cfg = config(name, tis_mode="mask", kl_loss_coef=0.1)
    T = b.mask.shape[1]
    for short, long in zip(advantages_for(cfg, b), advantages_for(cfg, padded), strict=True):
        torch.testing.assert_close(long[:, :T], short)
    loss, grad = loss_and_grad(cfg, b)
    padded_loss, padded_grad = loss_and_grad(cfg, padded)
    torch.testing.assert_close(padded_loss, loss)
    torch.testing.assert_close(padded_grad[:, :T], grad)
    assert torch.equal(padded_grad[:, T:], torch.zeros_like(padded_grad[:, T:]))


@SETTINGS
@given(
    loss_name=st.sampled_from(["ppo_clip_loss", "gspo_loss", "sapo_loss", "cispo_loss"]),
    mode=agg_modes,
    seed=seeds,
)
def test_on_policy_gradient_equals_vanilla_policy_gradient(loss_name, mode, seed):
    b = ref.random_batch(seed)
    logprobs = b.logprobs.clone().requires_grad_(True)
    loss_BT, _ = getattr(losses, loss_name)(logprobs, b.logprobs, b.advantages, b.mask)
    aggregate(loss_BT, b.mask, mode, loss_scale_factor=16.0).backward()
    vanilla = logprobs.detach().clone().requires_grad_(True)
    vanilla_BT = -torch.nan_to_num(b.advantages) * vanilla
    aggregate(vanilla_BT, b.mask, mode, loss_scale_factor=16.0).backward()
    torch.testing.assert_close(logprobs.grad, vanilla.grad)


@SETTINGS
@given(
    # M2PO solves its clip band on the tokens it is given (per micro-batch), so it is exempt.
    name=st.sampled_from([n for n in ALGORITHM_NAMES if n != "m2po"]),
    mode=agg_modes,
    num_ranks=st.integers(1, 4),
    seed=seeds,
)
def test_data_parallel_split_with_global_counts_reproduces_single_rank(name, mode, num_ranks, seed):
    b = ref.random_batch(seed, num_groups=4, group_size=2)
    cfg = config(name, loss_agg_mode=mode, kl_loss_coef=0.05, tis_mode="truncate")
    full_loss, full_grad = loss_and_grad(cfg, b)
    counts = {
        "global_num_tokens": int(b.mask.sum()),
        "global_num_seqs": int((b.mask.sum(-1) > 0).sum()),
        "dp_size": num_ranks,
    }
    rank_losses, rank_grads = [], []
    for rows in torch.arange(b.mask.shape[0]).tensor_split(num_ranks):
        shard = ref.Batch(**{k: v[rows] for k, v in vars(b).items()})
        loss, grad = loss_and_grad(cfg, shard, **counts)
        rank_losses.append(loss)
        rank_grads.append(grad)
    torch.testing.assert_close(torch.stack(rank_losses).mean(), full_loss)
    torch.testing.assert_close(torch.cat(rank_grads) / num_ranks, full_grad)


@SETTINGS
@given(
    name=st.sampled_from(ALGORITHM_NAMES),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    advantage_scale=st.sampled_from([1e-6, 1.0, 1e3]),
    seed=seeds,
)
def test_no_nan_escapes_for_finite_inputs(name, scale, advantage_scale, seed):
    b = ref.random_batch(seed, log_ratio_scale=scale, poison=1e30)
    b.scores = b.scores * advantage_scale
    cfg = config(name, tis_mode="mask", kl_loss_coef=0.1, kl_loss_type="k3+", entropy_coef=0.01)
    spec = resolve(cfg)
    b.advantages, returns = advantages_for(cfg, b)
    logprobs = b.logprobs.clone().requires_grad_(True)
    loss, metrics = actor_loss(
        spec, logprobs, b.old_logprobs, b.advantages, b.mask,
        rollout_logprobs_BT=b.rollout_logprobs, ref_logprobs_BT=b.ref_logprobs,
        entropy_BT=b.values.abs(),
    )  # fmt: skip
    loss.backward()
    assert torch.isfinite(b.advantages).all() and torch.isfinite(returns).all()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
