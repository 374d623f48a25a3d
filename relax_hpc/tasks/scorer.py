"""The ``addition_scorer`` task (``rewards.reward_models.<name>.warm_start``): grpo_tiny_rm's
reward model, a tiny score head for additions.

A sequence classifier built from ``arch`` (``Qwen3ForSequenceClassification``, one logit,
the built-in character tokenizer) reads ``"37+48=58"`` (the reward model template
``{prompt}{response}``) and learns, with a binary cross-entropy on its logit, whether the
candidate is the sum: half of its training rows carry the right sum, half a plausible
mistake (``data.tasks``: forgotten carries, one wrong digit, a digit too many or too few,
the sum reversed, a random number). Its sigmoid is then a score in 0..1 that correlates
with correctness; how well is measured once on held-out pairs and stored in
``warmstart.json`` (``auc``: how often a right answer outscores a wrong one; ``agreement``:
score > 0.5 vs exact match).

Cached like the policy's warm start (``tasks.warm_start.cached_training``): trained once
per (model, task, recipe), published atomically under ``cache_dir/scorer-<key>`` as a normal
HF folder that ``rollout.rewards.reward_model.load_reward_model`` loads like a user's.

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
from relax_hpc.models.build import build_from_arch, build_tokenizer
from relax_hpc.tasks.addition import cache_key_fields, sample_operands
from relax_hpc.tasks.base import Task
from relax_hpc.tasks.warm_start import cached_training, first_good_seed, fit_supervised

SCORER_VERSION = 1  # bump when the recipe below changes


@dataclass(frozen=True)
class ScorerWarmStartConfig:
    """The supervised recipe; a seed whose held-out AUC is below ``min_auc`` is replaced by
    the next (up to ``max_attempts``), as the verifier's is (``first_good_seed``)."""

    steps: int = 600
    batch_size: int = 128
    lr: float = 5e-3
    warmup_steps: int = 30
    decay_fraction: float = 0.3
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    correct_share: float = 0.5  # rows whose candidate is the right sum
    measure_rows: int = 1024  # held-out rows the AUC and agreement are measured on
    seed: int = 0
    min_auc: float = 0.9
    max_attempts: int = 3


def scored_text(a: int, b: int, candidate: str) -> str:
    """What the reward model reads: its template ``{prompt}{response}``."""
    return f"{addition_prompt(a, b)}{candidate}"


def warm_start_scorer(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    cache_dir: str | Path,
    cfg: ScorerWarmStartConfig = ScorerWarmStartConfig(),
    split_seed: int = 0,
) -> Path:
    """The reward model's HF folder for (model, task, recipe); trains it the first time only."""
    if data_cfg.kind != "synthetic_addition":
        raise ValueError(
            f"warm_start=addition_scorer is for data.kind=synthetic_addition, not {data_cfg.kind}"
        )
    tokenizer = build_tokenizer(model_cfg)
    key_fields = cache_key_fields(model_cfg, data_cfg, cfg, split_seed, tokenizer)  # type: ignore[arg-type]
    key_fields["version"] = f"scorer-{SCORER_VERSION}"
    task = AdditionTask(data_cfg.digits, data_cfg.eval_size, split_seed)
    found: dict[str, float] = {}

    def train_one(seed: int) -> tuple[PreTrainedModel, float]:
        model = build_score_head(model_cfg, tokenizer, seed)
        return model, train_scorer(model, tokenizer, task, dataclasses.replace(cfg, seed=seed))

    def train() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, float]:
        outcome = first_good_seed(
            cfg.seed,
            cfg.max_attempts,
            cfg.min_auc,
            train_one,
            lambda model: scorer_quality(model, tokenizer, task, cfg)["auc"],
            "reward model warm start (AUC)",
        )
        found.update(seed=outcome.seed, attempts=outcome.attempts)
        return outcome.model, tokenizer, outcome.loss

    def measure(model: PreTrainedModel) -> dict[str, float]:
        return {**scorer_quality(model, tokenizer, task, cfg), **found}

    return cached_training(Path(cache_dir), "scorer", key_fields, train, measure)


def build_score_head(
    model_cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> PreTrainedModel:
    """One logit trained with BCE (``multi_label_classification`` takes float labels)."""
    model = build_from_arch(model_cfg, tokenizer, torch.float32, seed=seed)
    if model.config.num_labels != 1:
        raise ValueError(
            "warm_start=addition_scorer trains a one-logit score head; set arch.num_labels=1"
        )
    model.config.problem_type = "multi_label_classification"
    return model


def train_scorer(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    cfg: ScorerWarmStartConfig,
) -> float:
    """Supervised BCE on right (1) and wrong (0) candidates; the last loss."""
    generator = torch.Generator().manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)

    def next_batch() -> dict[str, torch.Tensor]:
        texts, labels = [], []
        for a, b in sample_operands(task, cfg.batch_size, generator):
            candidate, correct = verification_candidate(a, b, rng, cfg.correct_share)
            texts.append(scored_text(a, b, candidate))
            labels.append([float(correct)])
        # The scorer's own tokenization (padding, BOS): training reads what scoring reads.
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        return {**batch, "labels": torch.tensor(labels)}

    return fit_supervised(model, cfg, next_batch)


@torch.no_grad()
def scorer_quality(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    cfg: ScorerWarmStartConfig,
) -> dict[str, float]:
    """On held-out pairs drawn like the training rows: ``auc`` (a right candidate outscores
    a wrong one), ``agreement`` (sigmoid > 0.5 vs exact match), the two rates."""
    rng = random.Random(f"scorer:{cfg.seed}")
    rows = []
    for _ in range(cfg.measure_rows):
        a, b = task.operands(rng.choice(task.eval_pair_indices))
        candidate, correct = verification_candidate(a, b, rng, cfg.correct_share)
        rows.append((scored_text(a, b, candidate), correct))
    batch = tokenizer([text for text, _ in rows], padding=True, return_tensors="pt")
    logits = model(**batch).logits[:, 0]
    correct = torch.tensor([c for _, c in rows])
    right, wrong = logits[correct], logits[~correct]
    says_yes = logits > 0
    return {
        "auc": round(float((right[:, None] > wrong[None, :]).float().mean()), 4),
        "agreement": round(float((says_yes == correct).float().mean()), 4),
        "true_positive_rate": round(float(says_yes[correct].float().mean()), 4),
        "true_negative_rate": round(float((~says_yes[~correct]).float().mean()), 4),
    }


def quality_in_words(measured: Mapping[str, Any]) -> str:
    """``warmstart.json``'s AUC and agreement, for the rollout's log."""
    return (
        f"ranks a right answer above a wrong one on {100 * measured['auc']:.1f}% of held-out "
        f"pairs (AUC); score > 0.5 agrees with exact match on {100 * measured['agreement']:.1f}%"
    )


TASK = Task(
    name="addition_scorer",
    data_kind="synthetic_addition",
    warm_start=warm_start_scorer,
    warm_starts="reward_model",
    reward="exact_match",  # the truth its scores are measured against
    quality=quality_in_words,
)
