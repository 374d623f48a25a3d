"""What every built-in task's warm start shares: the cache, its lock and metadata, the
supervised loop, seed search and progress reports.

A warm start is a model trained once, supervised, on a task's sloppy teacher, so that RL
starts from a weak but not hopeless base (each task's module, e.g. ``tasks.addition``, keeps
its recipe). The result is an HF folder (weights + tokenizer or processor +
``warmstart.json``) under ``cache_dir/<prefix>-<key>``, where ``key`` hashes everything that
affects the weights. It is trained once: written to a temp folder and renamed into place, so
a concurrent or crashed writer never leaves a partial folder under the final name.
Deterministic given its inputs.

Must not: know about RL, the run directory layout, the engines, or any one task.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.schema import ModelConfig
from relax_hpc.paths import fsync_file

log = logging.getLogger(__name__)

LOCKS_DIR = ".locks"  # in a cache folder: one lock file per warm start being trained
METADATA_NAME = "warmstart.json"


def cached_training(
    cache_dir: Path,
    prefix: str,
    key_fields: dict[str, Any],
    train: Callable[[], tuple[PreTrainedModel, Any, float]],
    measure: Callable[[PreTrainedModel], dict[str, float]] | None = None,
) -> Path:
    """``cache_dir/<prefix>-<key>``, ``key`` a hash of ``key_fields``: the cached folder, or
    the one ``train()`` makes (model, its tokenizer or processor (anything with
    ``save_pretrained``), final loss), published atomically with ``warmstart.json``, which
    also keeps what ``measure(model)`` found (e.g. a verifier's agreement)."""
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:16]
    folder = cache_dir / f"{prefix}-{key}"
    if (folder / METADATA_NAME).is_file():
        log.info("%s: cached at %s", prefix, folder)
        return folder
    # Processes that need a warm start at once (a media run's trainer and rollout both build
    # it) train it once: the others wait on its lock, then read the cache.
    with _training_lock(folder):
        if (folder / METADATA_NAME).is_file():
            log.info("%s: cached at %s (trained by another process)", prefix, folder)
            return folder
        started = time.monotonic()
        model, saver, final_loss = train()
        metadata = {
            "key": key,
            "inputs": key_fields,
            "final_loss": final_loss,
            "train_s": round(time.monotonic() - started, 2),
            **(measure(model) if measure else {}),
        }
        log.info("%s: trained in %.1f s, loss %.4f", prefix, metadata["train_s"], final_loss)
        return _publish(folder, model, saver, metadata)


@contextlib.contextmanager
def _training_lock(folder: Path) -> Iterator[None]:
    """``flock`` on ``.locks/<folder name>`` in the cache (a lock file is never deleted: a
    waiter could hold the old one while a newcomer locks a new one). Where the filesystem
    has no ``flock`` (some Lustre mounts) every process trains and the first to publish
    wins."""
    locks = folder.parent / LOCKS_DIR
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / folder.name, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:
            log.warning("warm start: no lock for %s (%s); training without it", folder, error)
        yield  # closing the file releases the lock


@dataclass(frozen=True)
class SeedOutcome:
    """One trained model of a seed search: the model, its last loss, its score, its seed,
    and how many seeds were tried to get it."""

    model: PreTrainedModel
    loss: float
    score: float
    seed: int
    attempts: int


def first_good_seed(
    first_seed: int,
    max_attempts: int,
    good_enough: float,
    train_one: Callable[[int], tuple[PreTrainedModel, float]],
    score: Callable[[PreTrainedModel], float],
    label: str,
) -> SeedOutcome:
    """Seeds ``first_seed``, ``+1``, ... until ``score(model) >= good_enough`` (the best one
    after ``max_attempts`` else, with a warning). Why: a short supervised recipe lands in a
    good or a bad basin by the seed, and which seeds are good can differ between CPUs (the
    same recipe is bit-exact on one machine only), so a gate on the measured result makes
    the warm start dependable wherever it is trained."""
    best: SeedOutcome | None = None
    for attempt in range(max_attempts):
        seed = first_seed + attempt
        model, loss = train_one(seed)
        measured = score(model)
        log.info("%s: seed %d scores %.4f (needs %.4f)", label, seed, measured, good_enough)
        if best is None or measured > best.score:
            best = SeedOutcome(model, loss, measured, seed, attempt + 1)
        if measured >= good_enough:
            break
    assert best is not None, "max_attempts must be >= 1"
    best = dataclasses.replace(best, attempts=attempt + 1)
    if best.score < good_enough:
        log.warning(
            "%s: no seed of %d reached %.4f (best %.4f, seed %d)",
            label,
            max_attempts,
            good_enough,
            best.score,
            best.seed,
        )
    return best


def tokenizer_fields(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    """The vocabulary and the chat template: a cached folder keeps the ones it was saved
    with, so both are part of its key."""
    vocab = tokenizer.backend_tokenizer.to_str()
    return {
        "tokenizer_sha256": hashlib.sha256(vocab.encode()).hexdigest(),
        "chat_template_sha256": hashlib.sha256(
            (tokenizer.chat_template or "").encode()
        ).hexdigest(),
    }


def warm_started_model_config(model_cfg: ModelConfig, folder: str | Path) -> ModelConfig:
    """``model_cfg`` pointing at the warm-started folder (weights and tokenizer from there;
    ``warm_start`` off: the folder is the warm start)."""
    return dataclasses.replace(model_cfg, path=str(folder), tokenizer="auto", warm_start=False)


class SupervisedRecipe(Protocol):
    """What ``fit_supervised`` reads of a recipe (every task's ``*WarmStartConfig``)."""

    steps: int
    lr: float
    warmup_steps: int
    decay_fraction: float
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float


# One forward's inputs, or several (inputs, weight) parts whose weighted losses are summed:
# rows of very different lengths in separate forwards instead of padded to the longest.
SupervisedBatch = Mapping[str, torch.Tensor] | Sequence[tuple[Mapping[str, torch.Tensor], float]]


# (step, total steps, loss) -> None: who is told of each supervised step's progress (the
# trainer's status file, for the console's progress line); set by ``progress_reports``.
ProgressReport = Callable[[int, int, float], None]
_PROGRESS: contextvars.ContextVar[ProgressReport | None] = contextvars.ContextVar(
    "warm_start_progress", default=None
)
REPORT_EVERY_STEPS = 10


@contextlib.contextmanager
def progress_reports(report: ProgressReport) -> Iterator[None]:
    """Every warm start trained inside (whichever recipe, however deep) tells ``report``
    its progress every ``REPORT_EVERY_STEPS`` steps and at its last step."""
    token = _PROGRESS.set(report)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def fit_supervised(
    model: PreTrainedModel,
    cfg: SupervisedRecipe,
    next_batch: Callable[[], SupervisedBatch],
    log_every_steps: int = 100,
) -> float:
    """``cfg.steps`` AdamW steps on ``model(**next_batch()).loss`` with ``cfg``'s lr, warm-up,
    decay, weight decay and clipping; the last loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, cfg))
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(cfg.steps):
        batch = next_batch()
        parts = [(batch, 1.0)] if isinstance(batch, Mapping) else batch
        loss = sum(weight * model(**inputs).loss for inputs, weight in parts)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        schedule.step()
        if (step + 1) % log_every_steps == 0:
            log.info("warm start: step %d/%d, loss %.4f", step + 1, cfg.steps, loss.item())
        report = _PROGRESS.get()
        if report is not None and ((step + 1) % REPORT_EVERY_STEPS == 0 or step + 1 == cfg.steps):
            report(step + 1, cfg.steps, loss.item())
    model.eval()
    return loss.item()


def supervised_batch(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], answers: list[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + answer + EOS`` ids, and labels that are -100 except answer + EOS."""
    prompt_rows = tokenizer(prompts)["input_ids"]
    answer_rows = tokenizer(answers, add_special_tokens=False)["input_ids"]
    rows = []
    for prompt_ids, answer_ids in zip(prompt_rows, answer_rows, strict=True):
        answer_ids = [*answer_ids, tokenizer.eos_token_id]
        rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
    return pad_rows(rows, tokenizer.pad_token_id)


def pad_rows(
    rows: Sequence[tuple[list[int], list[int]]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, labels)`` rows right-padded into tensors (labels padded with -100)."""
    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for row, (ids, label_row) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(label_row)] = torch.tensor(label_row)
    return input_ids, labels


def _lr_factor(step: int, cfg: SupervisedRecipe) -> float:
    decay_start = int(cfg.steps * (1 - cfg.decay_fraction))
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(1, cfg.steps - decay_start)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _publish(
    folder: Path,
    model: PreTrainedModel,
    tokenizer: Any,
    metadata: dict[str, Any],
) -> Path:
    """Write into a temp folder beside ``folder``, then rename it into place (first one wins)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / METADATA_NAME).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            fsync_file(path)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / METADATA_NAME).is_file():
                raise
            log.info("warm start: another process published %s first", folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
