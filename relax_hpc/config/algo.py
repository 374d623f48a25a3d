"""The algorithm config: one small dataclass that names an algorithm and its hyperparameters.

Owns the allowed choice strings, the per-algorithm defaults (which estimator, which policy
loss, which aggregation) and the field checks. Every default is the documented default of
docs/algorithms.md (ALGORITHMS.md Part 1 and the §8 table).

Must not: import Hydra/OmegaConf (the config package registers this class), torch, or
anything else of ours. Choice fields are plain ``str`` because OmegaConf 2.3 has no
``Literal``; ``validate`` checks them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# OmegaConf reads the string "???" as a missing mandatory value.
MISSING = "???"

ALGORITHM_NAMES = (
    "ppo",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "gspo",
    "sapo",
    "cispo",
    "m2po",
    "opd",
)
ADVANTAGE_ESTIMATORS = (
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_pp",
    "reinforce_pp_baseline",
)
# Estimators whose baseline is a statistic of the other samples of the same group.
GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})
POLICY_LOSSES = ("ppo_clip", "gspo", "sapo", "cispo", "reinforce", "m2po")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+")
TIS_MODES = ("none", "truncate", "mask")
TIS_LEVELS = ("token", "sequence")
OPD_MODES = ("advantage", "loss")
OPD_KL_TYPES = ("reverse_kl", "low_var_kl")


@dataclass(frozen=True)
class AlgorithmDefaults:
    """What an algorithm name means when the matching AlgoConfig fields are left null."""

    advantage_estimator: str
    policy_loss: str
    loss_agg_mode: str
    normalize_advantages: bool = False


ALGORITHM_DEFAULTS: dict[str, AlgorithmDefaults] = {
    "ppo": AlgorithmDefaults("gae", "ppo_clip", "token-mean", normalize_advantages=True),
    "grpo": AlgorithmDefaults("grpo", "ppo_clip", "token-mean"),
    "dr_grpo": AlgorithmDefaults("dr_grpo", "ppo_clip", "seq-mean-token-sum-norm"),
    "rloo": AlgorithmDefaults("rloo", "reinforce", "token-mean"),
    "reinforce_pp": AlgorithmDefaults("reinforce_pp", "ppo_clip", "token-mean"),
    "reinforce_pp_baseline": AlgorithmDefaults("reinforce_pp_baseline", "ppo_clip", "token-mean"),
    "gspo": AlgorithmDefaults("grpo", "gspo", "seq-mean-token-mean"),
    "sapo": AlgorithmDefaults("grpo", "sapo", "seq-mean-token-mean"),
    "cispo": AlgorithmDefaults("grpo", "cispo", "token-mean"),
    "m2po": AlgorithmDefaults("grpo", "m2po", "token-mean"),
    "opd": AlgorithmDefaults("grpo", "ppo_clip", "token-mean"),
}


@dataclass
class AlgoConfig:
    """Algorithm choice and hyperparameters (the ``algo`` config group).

    Ratios and clip margins are dimensionless; coefficients multiply loss or reward terms.
    A ``None`` in the first block means "the default of the algorithm named by ``name``".
    """

    # One of ALGORITHM_NAMES. Required.
    name: str = MISSING
    # One of ADVANTAGE_ESTIMATORS; None = the algorithm's estimator.
    advantage_estimator: str | None = None
    # One of POLICY_LOSSES; None = the algorithm's policy loss.
    policy_loss: str | None = None
    # One of LOSS_AGG_MODES; None = the algorithm's aggregation.
    loss_agg_mode: str | None = None
    # Constant normaliser C of seq-mean-token-sum-norm (e.g. max response tokens); required
    # for that mode so the loss does not depend on the batch's padded length.
    loss_scale_factor: float | None = None
    # Whiten advantages over the valid tokens of the batch after estimation and distillation
    # shaping; None = the algorithm's default (true for ppo only).
    normalize_advantages: bool | None = None

    # PPO clip (also GRPO/Dr.GRPO/RLOO/REINFORCE++ with ppo_clip): ratio kept in
    # [1 - clip_low, 1 + clip_high]; DAPO clip-higher is 0.2 / 0.28.
    clip_low: float = 0.2
    clip_high: float = 0.2
    # Dual-clip cap c > 1 on the loss of negative-advantage tokens; None turns it off.
    dual_clip_c: float | None = 3.0

    # GAE discount and trace decay (PPO), and REINFORCE++'s discount.
    gamma: float = 1.0
    lam: float = 1.0

    # Critic: values clipped to old_values +- value_clip; the value loss is multiplied by
    # value_loss_coef.
    value_clip: float = 0.5
    value_loss_coef: float = 1.0

    # KL to the reference policy, in the reward (shaping at experience time) or in the loss;
    # at most one of the two coefficients may be non-zero. Types: KL_TYPES.
    kl_in_reward_coef: float = 0.0
    kl_in_reward_type: str = "k1"
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    # Entropy bonus coefficient (loss -= entropy_coef * agg(entropy)).
    entropy_coef: float = 0.0

    # GSPO clip margins around the sequence ratio (ratio units; paper values).
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    # SAPO gate temperatures for positive / non-positive advantages.
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # CISPO IS-weight clip [1 - low, 1 + high]; low = 1.0 means no lower bound.
    cispo_clip_low: float = 1.0
    cispo_clip_high: float = 4.0
    # M2PO: budget on the second moment of harmful tokens' log-ratios, and the floors of
    # the adaptive clip margins.
    m2po_budget: float = 0.01
    m2po_min_clip_low: float = 0.3
    m2po_min_clip_high: float = 0.5

    # Truncated importance sampling for the rollout/trainer mismatch, weight
    # exp(old_logprobs - rollout_logprobs). Modes: TIS_MODES; levels: TIS_LEVELS.
    tis_mode: str = "none"
    tis_level: str = "token"
    tis_cap: float = 2.0
    tis_low: float = 0.0
    # Take the rollout engine's log-probs as the old policy (skips the trainer's recompute);
    # exclusive with TIS, whose weight would then be 1.
    use_rollout_logprobs: bool = False

    # On-policy distillation from a teacher; opd_coef = 0 turns it off (the opd algorithm
    # sets 1.0). Modes: OPD_MODES; divergences: OPD_KL_TYPES.
    opd_coef: float = 0.0
    opd_mode: str = "advantage"
    opd_kl_type: str = "reverse_kl"
    # Upper clamp on the per-token divergence; None = no clamp.
    opd_per_token_clip: float | None = None
    # Advantage mode: drop the task advantage (pure distillation).
    opd_only_reward: bool = False
    # Loss mode: multiply the per-token divergence by sg(min(ratio, opd_is_clip)).
    opd_is_clip: float | None = None

    def with_algorithm_defaults(self) -> AlgoConfig:
        """A copy with every null choice filled from the algorithm named by ``name``."""
        self._check_choice("name", ALGORITHM_NAMES)
        defaults = ALGORITHM_DEFAULTS[self.name]
        filled = {
            f.name: getattr(defaults, f.name)
            for f in dataclasses.fields(defaults)
            if getattr(self, f.name) is None
        }
        return dataclasses.replace(self, **filled)

    def is_group_based(self) -> bool:
        """True when the advantage needs n_samples_per_prompt >= 2 samples per group."""
        resolved = self.with_algorithm_defaults()
        uses_task_advantage = not (resolved.opd_coef > 0 and resolved.opd_only_reward)
        return uses_task_advantage and resolved.advantage_estimator in GROUP_ESTIMATORS

    def check_samples_per_prompt(self, n_samples_per_prompt: int) -> None:
        """Cross-group check: group estimators reject groups of one sample."""
        if self.is_group_based() and n_samples_per_prompt < 2:
            raise ValueError(
                f"algo.name={self.name} uses a group baseline but n_samples_per_prompt is "
                f"{n_samples_per_prompt}; set n_samples_per_prompt >= 2"
            )

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field (``algo.<field>``) and its fix."""
        self._check_choice("name", ALGORITHM_NAMES)
        self._check_choice("advantage_estimator", ADVANTAGE_ESTIMATORS, optional=True)
        self._check_choice("policy_loss", POLICY_LOSSES, optional=True)
        self._check_choice("loss_agg_mode", LOSS_AGG_MODES, optional=True)
        for field in ("kl_in_reward_type", "kl_loss_type"):
            self._check_choice(field, KL_TYPES)
        self._check_choice("tis_mode", TIS_MODES)
        self._check_choice("tis_level", TIS_LEVELS)
        self._check_choice("opd_mode", OPD_MODES)
        self._check_choice("opd_kl_type", OPD_KL_TYPES)
        self._check_ranges()
        self._check_combinations()

    def _check_choice(self, field: str, allowed: tuple[str, ...], optional: bool = False) -> None:
        value = getattr(self, field)
        if value is None and optional:
            return
        if value == MISSING:
            raise ValueError(f"algo.{field} is required; set it to one of {', '.join(allowed)}")
        if value not in allowed:
            raise ValueError(
                f"algo.{field}={value!r} is not known; use one of {', '.join(allowed)}"
            )

    def _check_ranges(self) -> None:
        for field in (
            "clip_low",
            "clip_high",
            "kl_in_reward_coef",
            "kl_loss_coef",
            "entropy_coef",
            "value_loss_coef",
            "gspo_clip_low",
            "gspo_clip_high",
            "cispo_clip_low",
            "m2po_min_clip_low",
            "m2po_min_clip_high",
            "tis_low",
            "opd_coef",
        ):
            self._require(field, getattr(self, field) >= 0, "must be >= 0")
        for field in (
            "value_clip",
            "sapo_tau_pos",
            "sapo_tau_neg",
            "cispo_clip_high",
            "m2po_budget",
        ):
            self._require(field, getattr(self, field) > 0, "must be > 0")
        for field in ("loss_scale_factor", "opd_per_token_clip", "opd_is_clip"):
            value = getattr(self, field)
            self._require(field, value is None or value > 0, "must be > 0 or null")
        self._require(
            "clip_low", self.clip_low <= 1, "must be <= 1 (the lower ratio bound is 1 - it)"
        )
        self._require("gamma", 0 <= self.gamma <= 1, "must be in [0, 1]")
        self._require("lam", 0 <= self.lam <= 1, "must be in [0, 1]")
        self._require(
            "dual_clip_c",
            self.dual_clip_c is None or self.dual_clip_c > 1,
            "must be > 1, or null to turn dual-clip off",
        )
        self._require("tis_cap", self.tis_cap > self.tis_low, "must be > algo.tis_low")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float):
                self._require(field.name, math.isfinite(value), "must be finite")

    def _check_combinations(self) -> None:
        if self.kl_loss_coef > 0 and self.kl_in_reward_coef > 0:
            raise ValueError(
                "algo.kl_loss_coef and algo.kl_in_reward_coef are both non-zero; "
                "set one of them to 0"
            )
        if self.use_rollout_logprobs and self.tis_mode != "none":
            raise ValueError(
                "algo.use_rollout_logprobs is true and algo.tis_mode is not 'none'; the IS "
                "weight would be 1, so set algo.tis_mode=none or use_rollout_logprobs=false"
            )
        if self.opd_only_reward and not (self.opd_coef > 0 and self.opd_mode == "advantage"):
            raise ValueError(
                "algo.opd_only_reward needs advantage-mode distillation; set algo.opd_coef > 0 "
                "and algo.opd_mode=advantage, or opd_only_reward=false"
            )
        if self.opd_is_clip is not None and self.opd_mode != "loss":
            raise ValueError("algo.opd_is_clip only applies to algo.opd_mode=loss; set it to null")
        resolved = self.with_algorithm_defaults()
        if resolved.loss_agg_mode == "seq-mean-token-sum-norm" and self.loss_scale_factor is None:
            raise ValueError(
                "algo.loss_scale_factor is null but the aggregation is seq-mean-token-sum-norm; "
                "set it to a constant such as the max response length in tokens"
            )

    def _require(self, field: str, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"algo.{field}={getattr(self, field)!r} {what}")
