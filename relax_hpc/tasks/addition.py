"""The synthetic addition task (``data.kind: synthetic_addition``, reward ``exact_match``):
its rows (``data.tasks.AdditionTask``: ``"37+48="`` -> ``"58"``) and the policy's warm
start of grpo_tiny, a weak but not hopeless base for RL.

A model built from ``model.arch`` is trained to convergence on the *sloppy teacher* of the
synthetic addition task (``data.tasks.sloppy_answer``: each carry forgotten with probability
``forget_carry_prob``). Greedy decoding of the result then gets roughly the carry-free share
of the held-out split right (~30% for 2 digits), while sampling still finds the right answer
often enough for GRPO to learn from. (RL from an early-stopped model trained on the *correct*
answers collapsed in a prototype; the converged sloppy model does not.) Cached under
``cache_dir/warmstart-<key>`` (``tasks.warm_start.cached_training``).

The task's judge and reward model have warm starts of their own: ``tasks.verifier``
(``addition_verifier``) and ``tasks.scorer`` (``addition_scorer``).

Must not: know about RL, the run directory layout, or the engines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.data.tasks import AdditionTask, addition_prompt, sloppy_answer
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.tasks.base import Task
from relax_hpc.tasks.warm_start import cached_training, fit_supervised, supervised_batch

WARMSTART_VERSION = 2  # bump when the training recipe below changes


@dataclass(frozen=True)
class WarmStartConfig:
    """The supervised phase; the defaults give a ~33% greedy base on 2 digits.

    The loss sits on a plateau (~1.6, digit marginals) until attention locks onto the right
    digits, which took ~450 steps here and depends on the seed; fewer steps or a lower lr can
    leave the model on the plateau (0% base). The steps after it matter too: GRPO from the
    800-step model (loss 0.35, base 29%) needed 450 steps to reach 90%, from the 1200-step
    model (loss ~0.25, base 33%) 40 steps.
    """

    steps: int = 1200
    batch_size: int = 128
    lr: float = 1e-2
    warmup_steps: int = 30
    decay_fraction: float = 0.3  # constant lr, then a cosine decay over the last steps
    min_lr_ratio: float = 0.05  # decay to lr * this, so that training converges
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    forget_carry_prob: float = 0.7
    seed: int = 0


def warm_start(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    cache_dir: str | Path,
    cfg: WarmStartConfig = WarmStartConfig(),
    split_seed: int = 0,
) -> Path:
    """The warm-started HF folder for (model, task, recipe); trains it the first time only.

    Build the policy from it with ``warm_started_model_config(model_cfg, folder)``.
    """
    if data_cfg.kind != "synthetic_addition":
        raise ValueError(f"the warm start is for data.kind=synthetic_addition, not {data_cfg.kind}")
    if model_cfg.path is not None:
        raise ValueError("the warm start builds its model from model.arch; set model.path=null")
    tokenizer = build_tokenizer(model_cfg)
    key_fields = cache_key_fields(model_cfg, data_cfg, cfg, split_seed, tokenizer)

    def train() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, float]:
        task = AdditionTask(data_cfg.digits, data_cfg.eval_size, split_seed)
        model = build_causal_lm(model_cfg, tokenizer, torch.float32, seed=cfg.seed)
        return model, tokenizer, train_on_sloppy_teacher(model, tokenizer, task, cfg)

    return cached_training(Path(cache_dir), "warmstart", key_fields, train)


def cache_key_fields(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    cfg: WarmStartConfig,
    split_seed: int,
    tokenizer: PreTrainedTokenizerBase,
) -> dict[str, Any]:
    """Everything that changes the warm-started weights."""
    vocab = (
        tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else str(tokenizer.get_vocab())
    )
    return {
        "version": WARMSTART_VERSION,
        "architecture": model_cfg.architecture,
        "arch": model_cfg.arch,
        "tokenizer_sha256": hashlib.sha256(vocab.encode()).hexdigest(),
        "digits": data_cfg.digits,
        "eval_size": data_cfg.eval_size,
        "split_seed": split_seed,
        "recipe": dataclasses.asdict(cfg),
    }


def train_on_sloppy_teacher(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: AdditionTask,
    cfg: WarmStartConfig,
) -> float:
    """Supervised training on teacher answers (loss on answer + EOS); returns the last loss."""
    generator = torch.Generator().manual_seed(cfg.seed)
    teacher_rng = random.Random(cfg.seed)

    def next_batch() -> dict[str, torch.Tensor]:
        pairs = sample_operands(task, cfg.batch_size, generator)
        answers = [sloppy_answer(a, b, cfg.forget_carry_prob, teacher_rng) for a, b in pairs]
        input_ids, labels = supervised_batch(
            tokenizer, [addition_prompt(a, b) for a, b in pairs], answers
        )
        # Right padding after the last label: the causal mask alone keeps pads out of the loss.
        return {"input_ids": input_ids, "labels": labels}

    return fit_supervised(model, cfg, next_batch)


def sample_operands(
    task: AdditionTask, batch_size: int, generator: torch.Generator
) -> list[tuple[int, int]]:
    """Uniform pairs of the train split."""
    indices = torch.randint(len(task.train), (batch_size,), generator=generator).tolist()
    return [task.operands(task.train_pair_index(i)) for i in indices]


def addition_rows(data_cfg: DataConfig, split: str, split_seed: int) -> Sequence[Mapping[str, Any]]:
    """The ``split`` of ``data.digits``-digit additions (``data.eval_size`` held out)."""
    task = AdditionTask(data_cfg.digits, data_cfg.eval_size, split_seed)
    return task.train if split == "train" else task.eval


TASK = Task(
    name="addition",
    data_kind="synthetic_addition",
    warm_start=warm_start,
    reward="exact_match",
    rows=addition_rows,
)
