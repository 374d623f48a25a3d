"""The ``addition_verifier`` task (``judge.warm_start``): grpo_tiny_judge's judge, a tiny
model that verifies additions.

A model built from ``judge.model.arch`` learns to answer ``yes`` or ``no`` after
``"37+48=58?"`` (the judge template ``addition_verifier``: prompt, response, ``?``): half of
its training rows carry the right sum, half a plausible mistake (``data.tasks``:
forgotten carries, one wrong digit, a digit too many or too few, the sum reversed, a random
number). It is deliberately short-trained and small, so it is *imperfect*: its agreement
with exact match on held-out pairs is measured once and stored in ``warmstart.json``
(``agreement``, ``true_positive_rate``, ``true_negative_rate``), and a GRPO run that uses
it as the only reward measures it again on the policy's own answers.

Cached like the policy's warm start (``tasks.warm_start.cached_training``): trained once
per (model, task, recipe), published atomically under ``cache_dir/verifier-<key>``.

Must not: know about RL, rewards, the run directory or the engines.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.data.tasks import AdditionTask, addition_prompt, verification_candidate
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.tasks.addition import cache_key_fields, sample_operands
from relax_hpc.tasks.base import Task
from relax_hpc.tasks.warm_start import (
    cached_training,
    first_good_seed,
    fit_supervised,
    supervised_batch,
)

VERIFIER_VERSION = 2  # bump when the recipe below changes
YES, NO = "yes", "no"


@dataclass(frozen=True)
class VerifierWarmStartConfig:
    """The supervised recipe; the defaults give 88-90% agreement with exact match (2 digits).

    How good a seed's verifier is varies: measured on one CPU, seed 0 agreed on 85.6% of
    held-out rows (no to only 71.6% of wrong sums: a policy learns little from it), seed 1
    on 88.2% (no to 82.4%); on another CPU seed 0 gave ~90%. So a seed below
    ``min_agreement`` is replaced by the next, up to ``max_attempts``; ``warmstart.json``
    keeps the seed used and how many were tried.
    """

    steps: int = 1500
    batch_size: int = 128
    lr: float = 1e-2
    warmup_steps: int = 30
    decay_fraction: float = 0.3  # constant lr, then a cosine decay over the last steps
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    correct_share: float = 0.5  # rows whose candidate is the right sum
    agreement_rows: int = 1024  # held-out rows the agreement is measured on
    seed: int = 0
    min_agreement: float = 0.88
    max_attempts: int = 3


def verification_text(a: int, b: int, candidate: str) -> str:
    """What the judge reads: the judge template ``addition_verifier`` of prompt and response."""
    return f"{addition_prompt(a, b)}{candidate}?"


def warm_start_verifier(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    cache_dir: str | Path,
    cfg: VerifierWarmStartConfig = VerifierWarmStartConfig(),
    split_seed: int = 0,
) -> Path:
    """The verifier's HF folder for (model, task, recipe); trains it the first time only."""
    if data_cfg.kind != "synthetic_addition":
        raise ValueError(
            f"judge.warm_start=addition_verifier is for data.kind=synthetic_addition, not "
            f"{data_cfg.kind}"
        )
    if model_cfg.path is not None:
        raise ValueError(
            "judge.warm_start=addition_verifier builds its model from judge.model.arch; set "
            "judge.model.path=null"
        )
    tokenizer = build_tokenizer(model_cfg)
    key_fields = cache_key_fields(model_cfg, data_cfg, cfg, split_seed, tokenizer)  # type: ignore[arg-type]
    key_fields["version"] = f"verifier-{VERIFIER_VERSION}"
    task = AdditionTask(data_cfg.digits, data_cfg.eval_size, split_seed)

    found: dict[str, float] = {}

    def train_one(seed: int) -> tuple[PreTrainedModel, float]:
        seeded = dataclasses.replace(cfg, seed=seed)
        model = build_causal_lm(model_cfg, tokenizer, torch.float32, seed=seed)
        return model, train_verifier(model, tokenizer, task, seeded)

    def train() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, float]:
        outcome = first_good_seed(
            cfg.seed,
            cfg.max_attempts,
            cfg.min_agreement,
            train_one,
            lambda model: verifier_agreement(model, tokenizer, task, cfg)["agreement"],
            "verifier warm start (agreement)",
        )
        found.update(seed=outcome.seed, attempts=outcome.attempts)
        return outcome.model, tokenizer, outcome.loss

    def measure(model: PreTrainedModel) -> dict[str, float]:
        return {**verifier_agreement(model, tokenizer, task, cfg), **found}

    return cached_training(Path(cache_dir), "verifier", key_fields, train, measure)


def train_verifier(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    cfg: VerifierWarmStartConfig,
) -> float:
    """Supervised training on ``yes``/``no`` after each row (loss on the verdict + EOS)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)

    def next_batch() -> dict[str, torch.Tensor]:
        texts, verdicts = [], []
        for a, b in sample_operands(task, cfg.batch_size, generator):
            candidate, correct = verification_candidate(a, b, rng, cfg.correct_share)
            texts.append(verification_text(a, b, candidate))
            verdicts.append(YES if correct else NO)
        input_ids, labels = supervised_batch(tokenizer, texts, verdicts)
        return {"input_ids": input_ids, "labels": labels}

    return fit_supervised(model, cfg, next_batch)


@torch.no_grad()
def verifier_agreement(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    cfg: VerifierWarmStartConfig,
) -> dict[str, float]:
    """How often the verifier's first verdict token agrees with exact match, on held-out pairs.

    Rows are drawn like the training rows (half right), from the held-out split only.
    """
    rng = random.Random(f"agreement:{cfg.seed}")
    rows = []
    for _ in range(cfg.agreement_rows):
        a, b = task.operands(rng.choice(task.eval_pair_indices))
        candidate, correct = verification_candidate(a, b, rng, cfg.correct_share)
        rows.append((verification_text(a, b, candidate), correct))
    batch = tokenizer([text for text, _ in rows], return_tensors="pt", padding=True)
    logits = model(**batch).logits[:, -1]  # left padding: the last position is the verdict's
    yes_id, no_id = (tokenizer.convert_tokens_to_ids(word[0]) for word in (YES, NO))
    says_yes = logits[:, yes_id] > logits[:, no_id]
    correct = torch.tensor([c for _, c in rows])
    return {
        "agreement": round(float((says_yes == correct).float().mean()), 4),
        "true_positive_rate": round(float(says_yes[correct].float().mean()), 4),
        "true_negative_rate": round(float((~says_yes[~correct]).float().mean()), 4),
    }


def quality_in_words(measured: Mapping[str, Any]) -> str:
    """``warmstart.json``'s agreement, for the rollout's log."""
    return (
        f"agrees with exact match on {100 * measured['agreement']:.1f}% of held-out rows (says "
        f"yes to {100 * measured['true_positive_rate']:.1f}% of right answers, no to "
        f"{100 * measured['true_negative_rate']:.1f}% of wrong ones)"
    )


TASK = Task(
    name="addition_verifier",
    data_kind="synthetic_addition",
    warm_start=warm_start_verifier,
    warm_starts="judge",
    reward="exact_match",  # the truth its verdicts are measured against
    quality=quality_in_words,
)
