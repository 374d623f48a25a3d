"""Reward services: how a sample's reward is composed, reward models, remote endpoints.

``rollout.reward`` names one *reward part* or ``composite``. A part name is, in this order:
``judge`` (the generative reward model of the ``judge`` section), a key of
``rewards.reward_models`` (a sequence-classification model from a local folder), a key of
``rewards.endpoints`` (an HTTP server of the user's), else a rule reward (a built-in name
or ``module:function``). ``composite`` adds up parts with ``rewards.weights``, or with
``rewards.weights_by_source[<source>]`` for rows whose ``rewards.source_key`` column names
that source. A part with weight 0 is still scored and logged (a monitor, e.g. exact match
beside a judge), and ``rewards.agreement_with`` names the part every other part's verdict
is compared with (``reward/agreement/<part>``).

Endpoint credentials are secrets, handled like alert URLs: a ``token`` given in a config
is moved at submission into ``RunPaths.endpoint_token_file`` (0600) and ``config.yaml``
keeps none; else ``token_file`` (a 0600 file) or the environment variable ``token_env``.

Plain dataclasses (no Hydra import); ``validate`` raises ``ValueError`` naming
``rewards.<field>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

MISSING: Any = "???"
COMPOSITE = "composite"
JUDGE_PART = "judge"
RM_NORMALIZATIONS = ("none", "sigmoid")
RM_WARM_STARTS = ("none", "addition_scorer")


@dataclass
class ClientConfig:
    """How a client calls a reward server (an endpoint, or the judge in its own component).

    A batch of samples is cut into requests of ``batch_size`` items, at most
    ``max_concurrency`` in flight, each with a ``timeout_s``. A request answered badly (a
    timeout, a dropped connection, 5xx/429, a malformed answer) is retried until
    ``max_attempts`` answers were had; a server that is not reachable at all (refused, the
    judge restarting) is tried again without using up attempts. Tries are ``backoff_s *
    2**k`` seconds apart (capped at ``backoff_max_s``, with +-50% jitter). After
    ``breaker_failures`` failures in a row the circuit opens: requests wait
    ``breaker_reset_s`` before one probe goes out. No sample waits longer than
    ``max_wait_s``: then it is scored as failed with the reason, and the run goes on.
    """

    timeout_s: float = 30.0
    batch_size: int = 32
    max_concurrency: int = 4
    max_attempts: int = 4
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    breaker_failures: int = 5
    breaker_reset_s: float = 30.0
    max_wait_s: float = 300.0

    def validate(self, prefix: str) -> None:
        for name in ("timeout_s", "backoff_s", "backoff_max_s", "breaker_reset_s", "max_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{prefix}.{name} must be > 0 seconds, got {value!r}")
        for name in ("batch_size", "max_concurrency", "max_attempts", "breaker_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"{prefix}.{name} must be >= 1, got {getattr(self, name)!r}")


@dataclass
class EndpointConfig(ClientConfig):
    """A remote reward server that speaks ``relax_hpc.reward/1`` (see ``rewards/protocol``)."""

    url: str = MISSING  # http(s)://host[:port]/path; credentials go in token*, never here
    token: str | None = None  # moved into the run's secrets at submission
    token_file: str | None = None  # a 0600 file holding the token
    token_env: str | None = None  # an environment variable holding the token

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{prefix}.url must be an http(s)://host[:port]/path URL")
        if parts.username or parts.password:
            raise ValueError(
                f"{prefix}.url carries credentials; put the secret in {prefix}.token, "
                f"{prefix}.token_file or {prefix}.token_env (never logged, kept out of "
                "config.yaml)"
            )


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model (a score head): a local HF folder (``path``),
    or ``architecture`` built from ``arch`` with a built-in ``tokenizer`` (``path: null``),
    optionally trained first (``warm_start``, cached like the policy's warm start)."""

    path: str | None = MISSING
    # Built from config when path is null: a transformers *ForSequenceClassification class,
    # its config kwargs (num_labels included) and a built-in tokenizer (char)
    architecture: str = "Qwen3ForSequenceClassification"
    arch: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "char"
    # none | addition_scorer: train the built model to score additions first
    # (relax_hpc/tasks/scorer.py; data.kind=synthetic_addition)
    warm_start: str = "none"
    # What the model reads: {prompt}, {response}, {reference} and the row's columns.
    template: str = "{prompt}{response}"
    label: int = 0  # the logit that is the score (0 for a one-logit head)
    normalize: str = "none"  # none: the raw logit | sigmoid: squashed into 0..1
    batch_size: int = 16
    max_length: int = 2048  # tokens; longer texts keep their end (the response)
    dtype: str = "auto"

    def validate(self, prefix: str) -> None:
        self._check_source(prefix)
        if self.normalize not in RM_NORMALIZATIONS:
            raise ValueError(
                f"{prefix}.normalize {self.normalize!r} is not one of "
                f"{', '.join(RM_NORMALIZATIONS)}"
            )
        if "{response}" not in self.template:
            raise ValueError(f"{prefix}.template must contain {{response}}")
        for name in ("batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{prefix}.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.label < 0:
            raise ValueError(f"{prefix}.label must be >= 0, got {self.label}")

    def _check_source(self, prefix: str) -> None:
        if self.warm_start not in RM_WARM_STARTS:
            raise ValueError(
                f"{prefix}.warm_start {self.warm_start!r} is not one of {', '.join(RM_WARM_STARTS)}"
            )
        if self.path is None and not self.arch:
            raise ValueError(
                f"{prefix}.arch: a reward model with path null is built from arch; set "
                f"{prefix}.path to a local folder, or {prefix}.arch to its config kwargs"
            )
        if self.path is None and self.tokenizer == "auto":
            raise ValueError(
                f"{prefix}.tokenizer: 'auto' reads the tokenizer of path; a reward model built "
                "from arch needs tokenizer=char or a folder"
            )
        if self.path is not None and self.warm_start != "none":
            raise ValueError(
                f"{prefix}.path: warm_start={self.warm_start} trains a model built from arch; "
                f"set {prefix}.path=null"
            )
        if self.path is None and self.label >= self.arch.get("num_labels", 2):
            raise ValueError(
                f"{prefix}.label {self.label} is not a logit of a head with "
                f"arch.num_labels={self.arch.get('num_labels', 2)}; set {prefix}.label"
            )


@dataclass
class RewardsConfig:
    weights: dict[str, float] = field(default_factory=dict)  # part -> weight (composite)
    source_key: str | None = None  # the dataset column that names each row's data source
    # source -> {part: weight}; rows of other sources use ``weights``
    weights_by_source: dict[str, dict[str, Any]] = field(default_factory=dict)
    agreement_with: str | None = None  # a part every other part is compared with
    eval_reward: str | None = None  # the held-out accuracy's reward (default rollout.reward)
    reward_models: dict[str, RewardModelConfig] = field(default_factory=dict)
    endpoints: dict[str, EndpointConfig] = field(default_factory=dict)

    def validate(self, reward: str) -> RewardsConfig:
        """Checks that need no imports; ``reward`` is ``rollout.reward``."""
        for name, rm in self.reward_models.items():
            rm.validate(f"rewards.reward_models.{name}")
        for name, endpoint in self.endpoints.items():
            endpoint.validate(f"rewards.endpoints.{name}")
        clash = sorted(set(self.reward_models) & set(self.endpoints))
        reserved = sorted({COMPOSITE, JUDGE_PART} & (set(self.reward_models) | set(self.endpoints)))
        if clash or reserved:
            raise ValueError(
                f"rewards.reward_models/endpoints: part names must be unique and not "
                f"{COMPOSITE}/{JUDGE_PART} (got {', '.join(clash + reserved)}); rename one"
            )
        for source, table in self.weights_by_source.items():
            for part, weight in table.items():
                if not isinstance(weight, int | float) or not math.isfinite(weight):
                    raise ValueError(
                        f"rewards.weights_by_source: {source}.{part} must be a number, got "
                        f"{weight!r}"
                    )
        self._check_composite(reward)
        return self

    def _check_composite(self, reward: str) -> None:
        composed = bool(self.weights or self.weights_by_source)
        if reward == COMPOSITE and not composed:
            raise ValueError(
                "rewards.weights: rollout.reward=composite adds up weighted parts; set "
                "rewards.weights (e.g. {dapo_math: 1.0, judge: 0.5}) or "
                "rewards.weights_by_source"
            )
        if reward != COMPOSITE and composed:
            raise ValueError(
                f"rewards.weights: weights are set but rollout.reward={reward} scores one part; "
                "set rollout.reward=composite to use them"
            )
        if self.weights_by_source and not self.source_key:
            raise ValueError(
                "rewards.source_key: rewards.weights_by_source needs the dataset column that "
                "names each row's source (e.g. rewards.source_key=data_source)"
            )

    def part_names(self, reward: str) -> list[str]:
        """Every part a run scores: what ``reward`` names, plus monitors and the eval reward."""
        if reward == COMPOSITE:
            names = [*self.weights]
            names += [p for table in self.weights_by_source.values() for p in table]
        else:
            names = [reward]
        names += [n for n in (self.agreement_with, self.eval_reward) if n]
        return list(dict.fromkeys(names))
