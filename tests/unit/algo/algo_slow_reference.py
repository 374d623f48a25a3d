"""Slow, obviously-correct references: plain Python loops over samples and tokens, in float64.

Written from docs/algorithms.md, not from the implementation. Batches are nested lists
``x[i][t]``; ``m[i][t]`` is 0/1. Masked positions are never read, so NaN there is harmless.
Also: a random ragged batch generator (interior masked tokens, empty rows, NaN padding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ---------------------------------------------------------------- random batches


@dataclass
class Batch:
    mask: torch.Tensor  # [B, T] float 0/1
    group_ids: torch.Tensor  # [B] int64
    scores: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B, T], the rest likewise, NaN where masked
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    teacher_logprobs: torch.Tensor
    advantages: torch.Tensor
    values: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor


def random_batch(
    seed: int,
    num_groups: int = 3,
    group_size: int = 3,
    max_len: int = 9,
    log_ratio_scale: float = 0.3,
    poison: float = float("nan"),
) -> Batch:
    """Ragged batch: random lengths (some 0), interior masked tokens, ``poison`` where masked."""
    gen = torch.Generator().manual_seed(seed)
    num_samples = num_groups * group_size
    lengths = torch.randint(0, max_len + 1, (num_samples,), generator=gen)
    positions = torch.arange(max_len)[None, :]
    mask = (positions < lengths[:, None]).float()
    interior = torch.rand(num_samples, max_len, generator=gen) < 0.2
    mask = torch.where(interior & (positions < lengths[:, None] - 1), 0.0, mask)
    group_ids = torch.arange(num_groups).repeat_interleave(group_size)
    group_ids = group_ids[torch.randperm(num_samples, generator=gen)] * 7 + 3

    def noise(scale: float = 1.0) -> torch.Tensor:
        return scale * torch.randn(num_samples, max_len, generator=gen)

    logprobs = -torch.rand(num_samples, max_len, generator=gen) * 3
    fields = {
        "logprobs": logprobs,
        "old_logprobs": logprobs + noise(log_ratio_scale),
        "ref_logprobs": logprobs + noise(0.5),
        "rollout_logprobs": logprobs + noise(log_ratio_scale) + noise(0.3),
        "teacher_logprobs": logprobs + noise(0.7),
        "advantages": noise(),
        "values": noise(),
        "old_values": noise(),
        "returns": noise(),
    }
    valid = mask.bool()
    poisoned = {k: torch.where(valid, v, torch.full_like(v, poison)) for k, v in fields.items()}
    scores = torch.randn(num_samples, generator=gen)
    return Batch(mask=mask, group_ids=group_ids, scores=scores, **poisoned)


def lists(x: torch.Tensor) -> list:
    return x.detach().double().tolist()


# ---------------------------------------------------------------- advantages


def group_members(groups: list[int], i: int) -> list[int]:
    return [j for j in range(len(groups)) if groups[j] == groups[i]]


def broadcast(per_sample: list[float], m: list[list[float]]) -> list[list[float]]:
    return [[per_sample[i] if m[i][t] else 0.0 for t in range(len(m[i]))] for i in range(len(m))]


def kept(scored, groups) -> list[bool]:
    """Scored samples of groups with at least two scored samples (None: all scored)."""
    if scored is None:
        return [True] * len(groups)
    return [
        bool(scored[i]) and sum(bool(scored[j]) for j in group_members(groups, i)) >= 2
        for i in range(len(groups))
    ]


def grpo(scores, m, groups, divide_by_std=True, eps=1e-6, scored=None):
    keep = kept(scored, groups)
    out = []
    for i in range(len(scores)):
        if not keep[i]:
            out.append(0.0)
            continue
        members = [scores[j] for j in group_members(groups, i) if keep[j]]
        mu = sum(members) / len(members)
        std = math.sqrt(sum((s - mu) ** 2 for s in members) / (len(members) - 1))
        out.append((scores[i] - mu) / (std + eps) if divide_by_std else scores[i] - mu)
    return broadcast(out, m)


def rloo(scores, m, groups, scored=None):
    keep = kept(scored, groups)
    out = []
    for i in range(len(scores)):
        others = [scores[j] for j in group_members(groups, i) if j != i and keep[j]]
        out.append(scores[i] - sum(others) / len(others) if keep[i] else 0.0)
    return broadcast(out, m)


def whiten(x, m):
    valid = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if m[i][t]]
    if not valid:
        return [[0.0] * len(row) for row in x]
    mean = sum(valid) / len(valid)
    var = sum((v - mean) ** 2 for v in valid) / len(valid)
    scale = 1 / math.sqrt(max(var, 1e-8))
    return [
        [(x[i][t] - mean) * scale if m[i][t] else 0.0 for t in range(len(x[i]))]
        for i in range(len(x))
    ]


def reinforce_pp_baseline(scores, m, groups, scored=None):
    keep = kept(scored, groups)
    m_kept = [[m[i][t] if keep[i] else 0.0 for t in range(len(m[i]))] for i in range(len(m))]
    return whiten(grpo(scores, m, groups, divide_by_std=False, scored=scored), m_kept)


def token_rewards(scores, m, kl=None):
    """Score at the last valid token, minus per-token KL penalty on valid tokens."""
    out = []
    for i, row in enumerate(m):
        valid = [t for t in range(len(row)) if row[t]]
        rewards = [
            (-kl[i][t] if kl is not None else 0.0) if row[t] else 0.0 for t in range(len(row))
        ]
        if valid:
            rewards[valid[-1]] += scores[i]
        out.append(rewards)
    return out


def discounted_returns(r, m, gamma):
    out = []
    for i, row in enumerate(m):
        returns = [0.0] * len(row)
        for t in range(len(row)):
            if row[t]:
                returns[t] = sum(gamma ** (u - t) * r[i][u] for u in range(t, len(row)) if m[i][u])
        out.append(returns)
    return out


def gae(r, v, m, gamma, lam):
    """GAE where 'next' means the next valid position of the same sample."""
    advantages, returns = [], []
    for i, row in enumerate(m):
        valid = [t for t in range(len(row)) if row[t]]
        adv = [0.0] * len(row)
        for k in reversed(range(len(valid))):
            t = valid[k]
            next_value = v[i][valid[k + 1]] if k + 1 < len(valid) else 0.0
            next_adv = adv[valid[k + 1]] if k + 1 < len(valid) else 0.0
            delta = r[i][t] + gamma * next_value - v[i][t]
            adv[t] = delta + gamma * lam * next_adv
        advantages.append(adv)
        returns.append([adv[t] + v[i][t] if row[t] else 0.0 for t in range(len(row))])
    return advantages, returns


# ---------------------------------------------------------------- KL, OPD, TIS


def kl_value(logp, ref, kind):
    x = logp - ref
    if kind in ("k1", "kl", "k1+"):
        return x
    if kind == "abs":
        return abs(x)
    if kind in ("k2", "mse"):
        return 0.5 * x * x
    neg = min(max(-x, -20.0), 20.0)
    return min(max(math.exp(neg) - 1 - neg, -10.0), 10.0)


def per_token(fn, m, *tensors):
    """``fn(*values at [i][t])`` on valid tokens, 0 elsewhere."""
    return [
        [fn(*(x[i][t] for x in tensors)) if m[i][t] else 0.0 for t in range(len(m[i]))]
        for i in range(len(m))
    ]


def opd_divergence(student, teacher, kind, clip=None):
    x = student - teacher
    value = x if kind == "reverse_kl" else math.exp(-x) - 1 + x
    return min(value, clip) if clip is not None else value


def tis_weights(old, rollout, m, mode, level, cap, low):
    out = []
    for i, row in enumerate(m):
        seq_log_w = sum(old[i][t] - rollout[i][t] for t in range(len(row)) if row[t])
        weights = []
        for t in range(len(row)):
            if not row[t]:
                weights.append(0.0)
                continue
            log_w = seq_log_w if level == "sequence" else old[i][t] - rollout[i][t]
            w = math.exp(min(max(log_w, -20.0), 20.0))
            if mode == "truncate":
                weights.append(min(max(w, low), cap))
            else:
                weights.append(w if low <= w <= cap else 0.0)
        out.append(weights)
    return out


# ---------------------------------------------------------------- policy / value losses


def ratio(logp, old):
    return math.exp(min(max(logp - old, -20.0), 20.0))


def clip(x, low, high):
    return min(max(x, low), high)


def ppo_token(logp, old, a, lo, hi, c):
    rho = ratio(logp, old)
    loss = max(-a * rho, -a * clip(rho, 1 - lo, 1 + hi))
    if c is not None and a < 0:
        loss = min(loss, -a * c)
    return loss


def ppo_token_grad(logp, old, a, lo, hi, c):
    """d loss / d logp: -A rho where the unclipped branch is active, else 0."""
    rho = ratio(logp, old)
    unclipped, clipped = -a * rho, -a * clip(rho, 1 - lo, 1 + hi)
    if c is not None and a < 0 and max(unclipped, clipped) > -a * c:
        return 0.0  # dual-clip cap: constant
    if clipped > unclipped:
        return 0.0  # clipped branch: constant
    return -a * rho


def gspo(logp, old, adv, m, lo, hi):
    out = []
    for i, row in enumerate(m):
        valid = [t for t in range(len(row)) if row[t]]
        seq = sum(logp[i][t] - old[i][t] for t in valid) / max(len(valid), 1)
        s = math.exp(min(seq, 10.0))
        out.append(
            [
                max(-adv[i][t] * s, -adv[i][t] * clip(s, 1 - lo, 1 + hi)) if row[t] else 0.0
                for t in range(len(row))
            ]
        )
    return out


def sapo_token(logp, old, a, tau_pos, tau_neg):
    tau = tau_pos if a > 0 else tau_neg
    return -a * (4 / tau) / (1 + math.exp(-tau * (ratio(logp, old) - 1)))


def cispo_token(logp, old, a, lo, hi):
    return -clip(ratio(logp, old), 1 - lo, 1 + hi) * a * logp


def m2po_margins(logp, old, adv, m, budget, floor_lo, floor_hi):
    tol = 1e-12
    d = []
    for i, row in enumerate(m):
        for t in range(len(row)):
            x = min(max(logp[i][t] - old[i][t], -20.0), 20.0)
            r, a = math.exp(x), adv[i][t]
            if row[t] and ((a > tol and r > 1 + tol) or (a < -tol and r < 1 - tol)):
                d.append(x * x)
    n = len(d)
    before = sum(d) / n if n else 0.0
    if before <= budget + tol:
        lo, hi, after = 1.0, 1e5 - 1, before
    else:
        d.sort()
        k = next(
            k for k in range(n) if (d[k] - tol) * (n - k - 1) + sum(d[: k + 1]) >= n * budget - tol
        )
        if k == 0:
            tau, after = 0.0, before
        else:
            tau = math.sqrt(max(d[k - 1] - tol, 0.0))
            after = (d[k - 1] * (n - k) + sum(d[:k])) / n
        lo, hi = 1 - math.exp(-tau), math.exp(tau) - 1
    return max(lo, floor_lo), max(hi, floor_hi), before, after


def value_token(v, v_old, ret, c):
    v_clipped = clip(v, v_old - c, v_old + c)
    return 0.5 * max((v - ret) ** 2, (v_clipped - ret) ** 2)


def entropy(logits_row):
    z_max = max(logits_row)
    exps = [math.exp(z - z_max) for z in logits_row]
    total = sum(exps)
    return -sum(e / total * math.log(e / total) for e in exps)


# ---------------------------------------------------------------- aggregation


def aggregate(loss, m, mode, scale=None):
    rows = [[loss[i][t] for t in range(len(m[i])) if m[i][t]] for i in range(len(m))]
    non_empty = [r for r in rows if r]
    if mode == "token-mean":
        num_tokens = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / num_tokens if num_tokens else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in non_empty) / len(non_empty) if non_empty else 0.0
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in non_empty) / len(non_empty) if non_empty else 0.0
    return sum(sum(r) for r in rows) / scale
