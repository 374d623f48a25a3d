"""The calculator task (``rollout.environment: calculator`` on ``data.kind:
synthetic_addition``): grpo_tiny_calculator's policy warm start, sloppy demonstrations of
whole two-turn episodes.

Like grpo_tiny's (``tasks.addition``), it gives RL a weak but not hopeless base, and is
cached under ``cache_dir/calculator-warmstart-<key>`` (trained once, published atomically).
A demonstration is an episode written the way the rollout writes it: the prompt, the
model's turns (the loss is on these), and between them the observations rendered by the
chat template exactly as the episode driver renders them (``models.chat_format``; no loss).

A model of ``model.arch`` with the tool-call tags as single tokens (``model.tokenizer:
char_tools``) is trained from scratch on a mix: ``tool_share`` of the demonstrations call
the calculator (``<tool_call>{"name":"calc","arguments":{"expr":"3+8"}}</tool_call>``),
read its answer (``11``) and answer right, least-significant digit first; the others answer
like a sloppy teacher that forgets carries. The result calls the tool in about half of its
episodes and copies well when it does: GRPO then finds that calling pays.

Must not: know about RL, the run directory layout, or the engines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.data.tasks import AdditionTask, addition_prompt, lsd_first, sloppy_answer
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.tasks.addition import sample_operands
from relax_hpc.tasks.base import Task
from relax_hpc.tasks.warm_start import (
    SupervisedBatch,
    cached_training,
    first_good_seed,
    fit_supervised,
    pad_rows,
    tokenizer_fields,
)

AGENT_WARMSTART_VERSION = 2  # bump when the recipe below changes (tasks.guess keys by it too)
log = logging.getLogger(__name__)
# The calculator environment's tool, as rollout/envs/calculator.py declares it.
CALC_NAME, CALC_ARGUMENT = "calc", "expr"

Row = tuple[list[int], list[int]]  # (input ids, labels: -100 where there is no loss)


@dataclass(frozen=True)
class ToolWarmStartConfig:
    """The calculator recipe (fields shared with ``WarmStartConfig`` mean the same).

    Sized for CI (the whole learning test, warm start included, in minutes on 2 cores) on
    1-digit operands. Copying the operands into the call is learned suddenly (the loss leaves
    a plateau at ~0.18), and when depends on the seed. Measured on this task and split
    (teacher-forced, held-out pairs), 250 steps: seed 0 writes the tool path right with
    probability 0.98 at lr 1.5e-2 (0.97 at 1e-2); seeds 1 and 2 stayed on the plateau at
    1.5e-2 (0.03, 0.01); a larger tool share did not make the escape reliable. So a seed
    that stays on the plateau is replaced by the next (``min_tool_path``,
    ``max_attempts``; ``warmstart.json`` keeps the seed used and its ``tool_path``). Direct
    answers are right on few held-out pairs (~3-10%: a lookup of the train pairs).
    """

    steps: int = 250
    batch_size: int = 32
    lr: float = 1.5e-2
    warmup_steps: int = 25
    decay_fraction: float = 0.3
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    tool_share: float = 0.5  # demonstrations that call the calculator (and then answer right)
    forget_carry_prob: float = 1.0  # the others answer like a teacher that forgets carries
    seed: int = 0
    # A seed whose model still miscopies (tool path right below min_tool_path on the
    # held-out pairs, teacher forced) is replaced by the next one, up to max_attempts.
    min_tool_path: float = 0.8
    max_attempts: int = 3


def calculator_warm_start(
    model_cfg: ModelConfig,
    data_cfg: DataConfig,
    cache_dir: Path,
    cfg: ToolWarmStartConfig = ToolWarmStartConfig(),
    split_seed: int = 0,
) -> Path:
    """A model of ``model.arch`` taught, sloppily, to answer or to call ``calc``."""
    if data_cfg.kind != "synthetic_addition":
        raise ValueError(f"the calculator is for data.kind=synthetic_addition, not {data_cfg.kind}")
    if model_cfg.path is not None:
        raise ValueError("the warm start builds its model from model.arch; set model.path=null")
    if cfg.max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {cfg.max_attempts}")
    tokenizer = build_tokenizer(model_cfg)
    chat = ChatFormat(tokenizer)
    key_fields = {
        "version": AGENT_WARMSTART_VERSION,
        "recipe": dataclasses.asdict(cfg),
        "architecture": model_cfg.architecture,
        "arch": model_cfg.arch,
        **tokenizer_fields(tokenizer),
        "digits": data_cfg.digits,
        "eval_size": data_cfg.eval_size,
        "split_seed": split_seed,
    }

    task = AdditionTask(data_cfg.digits, data_cfg.eval_size, split_seed)
    found: dict[str, float] = {}

    def train_one(seed: int) -> tuple[PreTrainedModel, float]:
        model = build_causal_lm(model_cfg, tokenizer, torch.float32, seed=seed)
        return model, fit_supervised(model, cfg, calculator_batches(chat, task, cfg, seed))

    def train() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, float]:
        """Seeds ``cfg.seed``, ``+1``, ... until the copy is learned (the best one else)."""
        outcome = first_good_seed(
            cfg.seed,
            cfg.max_attempts,
            cfg.min_tool_path,
            train_one,
            lambda model: tool_path_probability(model, chat, task),
            "calculator warm start (tool path right)",
        )
        found.update(
            tool_path=round(outcome.score, 4), seed=outcome.seed, attempts=outcome.attempts
        )
        return outcome.model, tokenizer, outcome.loss

    return cached_training(
        cache_dir, "calculator-warmstart", key_fields, train, measure=lambda _: dict(found)
    )


def calculator_batches(
    chat: ChatFormat, task: AdditionTask, cfg: ToolWarmStartConfig, seed: int
) -> Callable[[], SupervisedBatch]:
    """The recipe's mix: ``tool_share`` calls, the rest sloppy direct answers."""
    tokenizer = chat.tokenizer
    generator = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)

    def next_batch() -> SupervisedBatch:
        pairs = sample_operands(task, cfg.batch_size, generator)
        calls = [rng.random() < cfg.tool_share for _ in pairs]
        rows = [
            calculator_demonstration(chat, a, b)
            if call
            else direct_demonstration(
                tokenizer, sloppy_answer(a, b, cfg.forget_carry_prob, rng), a, b
            )
            for (a, b), call in zip(pairs, calls, strict=True)
        ]
        return weighted_parts(rows, calls, tokenizer.pad_token_id)

    return next_batch


@torch.no_grad()
def tool_path_probability(model: PreTrainedModel, chat: ChatFormat, task: AdditionTask) -> float:
    """The mean probability, over the held-out pairs, that the model, once it has chosen to
    call, writes the call and the final answer right (teacher forced)."""
    rows = [calculator_demonstration(chat, *task.operands(i)) for i in task.eval_pair_indices]
    input_ids, labels = pad_rows(rows, chat.tokenizer.pad_token_id)
    logprobs = torch.log_softmax(model(input_ids=input_ids).logits[:, :-1].float(), -1)
    targets = labels[:, 1:]
    scored = targets != -100
    token_logprobs = logprobs.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * scored
    first = scored.float().argmax(1)  # the <tool_call> token: the choice to call, not scored
    path = token_logprobs.sum(1) - token_logprobs[torch.arange(len(rows)), first]
    return float(path.exp().mean())


def tool_call_text(name: str, arguments: dict) -> str:
    """One call in Qwen3's tool-call format (compact JSON, which the parser accepts)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"


def calculator_demonstration(chat: ChatFormat, a: int, b: int) -> Row:
    """``a+b=`` -> call ``calc`` -> its answer (observation) -> the sum LSD-first + EOS."""
    tokenizer = chat.tokenizer
    prompt = tokenizer(addition_prompt(a, b))["input_ids"]
    call = chat.encode(tool_call_text(CALC_NAME, {CALC_ARGUMENT: f"{a}+{b}"}))
    # The turn ended at the stop string </tool_call>, not at an end-of-turn token.
    observation = chat.observation_ids([{"role": "tool", "content": str(a + b)}], None)
    answer = [*chat.encode(lsd_first(a + b)), tokenizer.eos_token_id]
    ids = prompt + call + observation + answer
    return ids, [-100] * len(prompt) + call + [-100] * len(observation) + answer


def direct_demonstration(tokenizer: PreTrainedTokenizerBase, answer: str, a: int, b: int) -> Row:
    prompt = tokenizer(addition_prompt(a, b))["input_ids"]
    ids = [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return prompt + ids, [-100] * len(prompt) + ids


def weighted_parts(rows: list[Row], kinds: list[bool], pad_token_id: int) -> SupervisedBatch:
    """Rows of each kind padded in their own forward, weighted by their share of the label
    tokens (the sum is the mean loss over every label token of the batch)."""
    total = sum(sum(t != -100 for t in labels) for _, labels in rows)
    parts = []
    for kind in (True, False):
        picked = [row for row, k in zip(rows, kinds, strict=True) if k == kind]
        if picked:
            input_ids, labels = pad_rows(picked, pad_token_id)
            weight = float((labels != -100).sum()) / total
            parts.append(({"input_ids": input_ids, "labels": labels}, weight))
    return parts


TASK = Task(
    name="calculator",
    data_kind="synthetic_addition",
    warm_start=calculator_warm_start,
    reward="exact_match",  # the calculator environment's final answer, scored
    environment="calculator",
)
