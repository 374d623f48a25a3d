"""The guess-number task (``data.kind: guess_number``, ``rollout.environment:
guess_number``, which scores each game): its rows (``data.tasks.GuessNumberTask``: one game
each) and grpo_tiny_guess's policy warm start, a model trained from scratch on games played
by a sloppy guesser that follows the higher/lower replies only sometimes.

Each game is an episode laid out the way the episode driver writes it (the model's turns
carry the loss, the replies rendered by the chat template carry none), cached under
``cache_dir/guess-warmstart-<key>`` like every task's warm start (``tasks.warm_start``).

Must not: know about RL, the run directory layout, or the engines.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.data.tasks import GuessNumberTask
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.tasks.base import Task
from relax_hpc.tasks.calculator import AGENT_WARMSTART_VERSION, Row
from relax_hpc.tasks.warm_start import (
    SupervisedBatch,
    cached_training,
    fit_supervised,
    pad_rows,
    tokenizer_fields,
)


@dataclass(frozen=True)
class GuessWarmStartConfig:
    """The guess_number recipe: games of a guesser that picks a number consistent with the
    replies so far with ``follow_prob``, else any number of the range."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-2
    warmup_steps: int = 30
    decay_fraction: float = 0.3
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    follow_prob: float = 0.5
    max_turns: int = 6  # a demonstration stops here, found or not
    seed: int = 0


def guess_warm_start(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    cache_dir: Path,
    cfg: GuessWarmStartConfig = GuessWarmStartConfig(),
) -> Path:
    """A model of ``model.arch`` trained from scratch on the sloppy guesser's games."""
    if model_cfg.path is not None:
        raise ValueError("the warm start builds its model from model.arch; set model.path=null")
    tokenizer = build_tokenizer(model_cfg)
    chat = ChatFormat(tokenizer)
    low, high = data_cfg.guess_range
    key_fields = {
        "version": AGENT_WARMSTART_VERSION,
        "recipe": dataclasses.asdict(cfg),
        "architecture": model_cfg.architecture,
        "arch": model_cfg.arch,
        **tokenizer_fields(tokenizer),
        "range": [low, high],
        "apply_chat_template": data_cfg.apply_chat_template,
    }

    def train() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, float]:
        model = build_causal_lm(model_cfg, tokenizer, torch.float32, seed=cfg.seed)
        rng = random.Random(cfg.seed)

        def next_batch() -> SupervisedBatch:
            rows = [
                guess_demonstration(chat, data_cfg, rng.randint(low, high), cfg, rng)
                for _ in range(cfg.batch_size)
            ]
            input_ids, labels = pad_rows(rows, tokenizer.pad_token_id)
            return {"input_ids": input_ids, "labels": labels}

        return model, tokenizer, fit_supervised(model, cfg, next_batch)

    return cached_training(cache_dir, "guess-warmstart", key_fields, train)


def guess_demonstration(
    chat: ChatFormat,
    data_cfg: DataConfig,
    secret: int,
    cfg: GuessWarmStartConfig,
    rng: random.Random,
) -> Row:
    """One game of the sloppy guesser, as the episode driver lays it out."""
    tokenizer = chat.tokenizer
    low, high = data_cfg.guess_range
    prompt_text = f"guess {low}-{high}:"
    if data_cfg.apply_chat_template:
        prompt_text = chat.render([{"role": "user", "content": prompt_text}])
        ids = chat.encode(prompt_text)
    else:
        ids = tokenizer(prompt_text)["input_ids"]
    labels = [-100] * len(ids)
    feasible = [low, high]
    eos_text = tokenizer.decode([tokenizer.eos_token_id], skip_special_tokens=False)
    for turn in range(cfg.max_turns):
        bounds = feasible if rng.random() < cfg.follow_prob else [low, high]
        guess = rng.randint(*bounds)
        action = [*chat.encode(str(guess)), tokenizer.eos_token_id]
        ids, labels = ids + action, labels + action
        if guess == secret or turn + 1 == cfg.max_turns:
            break
        if guess < secret:
            feasible[0] = max(feasible[0], guess + 1)
        else:
            feasible[1] = min(feasible[1], guess - 1)
        reply = "higher" if guess < secret else "lower"
        observation = chat.observation_ids([{"role": "user", "content": reply}], eos_text)
        ids, labels = ids + observation, labels + [-100] * len(observation)
    return ids, labels


GUESS_TRAIN_GAMES = 100_000  # games of the train split (drawn lazily)


def guess_rows(data_cfg: DataConfig, split: str, split_seed: int) -> Sequence[Mapping[str, Any]]:
    """Games with secrets in ``data.guess_range``: the eval split from ``split_seed + 1``."""
    low, high = data_cfg.guess_range
    if split == "train":
        return GuessNumberTask(GUESS_TRAIN_GAMES, low, high, split_seed)
    return GuessNumberTask(data_cfg.eval_size, low, high, split_seed + 1)


TASK = Task(
    name="guess_number",
    data_kind="guess_number",
    warm_start=guess_warm_start,
    environment="guess_number",  # which also scores each game
    rows=guess_rows,
)
