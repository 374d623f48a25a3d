"""The media tasks ``shapes`` (count shapes in an image) and ``pitch`` (which tone a clip
plays), ``data.kind: media_task``, reward ``exact_match``: their rows
(``data.media_tasks.MediaTask``) and the cached supervised warm start
of the tiny VL/Omni models, a weak but not hopeless base for RL (``tasks.addition`` is its
text twin; both use ``tasks.warm_start``'s loop and atomic publishing).

A tiny model of a media family (``models.multimodal``) is trained on the *sloppy teacher* of
a media task (``data.media_tasks.sloppy_label``: right with ``correct_prob``, else its
favourite class). Converged, it answers the favourite unless the media make it sure, so
greedy accuracy sits near chance while sampling still finds the right answer often: room
for GRPO to show that it learns to use the media.

The result is an HF folder (weights, tokenizer, processor, ``warmstart.json``) under
``cache_dir/media-warmstart-<key>``, ``key`` hashing everything that affects the weights;
trained once, published atomically. Deterministic given its inputs.

Must not: know about RL, the run directory layout, or the engines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.data.media_tasks import MediaExample, MediaTask, sloppy_label
from relax_hpc.media.inputs import collate_media
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.models.architectures import media_family
from relax_hpc.models.multimodal import build_tiny_media_model, tiny_arch, tiny_processor
from relax_hpc.tasks.base import Rows, Task, WarmStart
from relax_hpc.tasks.warm_start import cached_training, fit_supervised

log = logging.getLogger(__name__)

MEDIA_WARMSTART_VERSION = 1  # bump when the training recipe below changes
TASK_FAMILIES = {
    "shapes": ("qwen3_vl", "qwen2_5_omni", "qwen3_omni"),
    "pitch": ("qwen2_5_omni", "qwen3_omni"),
}
TASK_STEPS = {"shapes": 400, "pitch": 200}


@dataclass(frozen=True)
class MediaWarmStartConfig:
    """The supervised phase (fields shared with ``WarmStartConfig`` mean the same).

    Measured on 2 busy cores: the tiny Qwen3-VL needs ~400 steps before counting shapes
    shows in the loss (300 left a weaker base that GRPO took 3x longer to lift); the tiny
    Omni thinker hears the pitch within 200 (``for_task``).
    """

    steps: int = 400
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 10
    decay_fraction: float = 0.3
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    correct_prob: float = 0.4  # the teacher's share of right answers
    favourite: int = 0  # the class the teacher answers otherwise
    seed: int = 0

    @classmethod
    def for_task(cls, task_name: str) -> MediaWarmStartConfig:
        return cls(steps=TASK_STEPS.get(task_name, cls.steps))


def media_warm_start(
    family: str,
    task_name: str,
    cache_dir: str | Path,
    cfg: MediaWarmStartConfig | None = None,
    arch: Mapping[str, Any] | None = None,
    split_seed: int = 0,
) -> Path:
    """The warm-started HF folder for (family, arch, task, recipe); trained the first time.

    ``cfg`` defaults to ``MediaWarmStartConfig.for_task(task_name)``; load the folder with
    ``models.multimodal.load_media_model``.
    """
    cfg = cfg or MediaWarmStartConfig.for_task(task_name)
    if family not in TASK_FAMILIES.get(task_name, ()):
        raise ValueError(
            f"task {task_name!r} needs a model family of {TASK_FAMILIES.get(task_name)}, "
            f"not {family!r}"
        )
    processor = tiny_processor(family)
    key_fields = {
        "version": MEDIA_WARMSTART_VERSION,
        "family": family,
        "arch": tiny_arch(family, arch),
        "tokenizer_sha256": hashlib.sha256(
            processor.tokenizer.backend_tokenizer.to_str().encode()
        ).hexdigest(),
        "processor": processor.fingerprint,
        "task": task_name,
        "split_seed": split_seed,
        "recipe": dataclasses.asdict(cfg),
    }

    def train() -> tuple[PreTrainedModel, MediaProcessor, float]:
        model, processor = build_tiny_media_model(family, arch, seed=cfg.seed)
        task = MediaTask(task_name, split_seed=split_seed)
        return model, processor, train_on_sloppy_media_teacher(model, processor, task, cfg)

    return cached_training(Path(cache_dir), "media-warmstart", key_fields, train)


def train_on_sloppy_media_teacher(
    model: PreTrainedModel,
    processor: MediaProcessor,
    task: MediaTask,
    cfg: MediaWarmStartConfig,
) -> float:
    """Supervised training on teacher answers (loss on answer + EOS); returns the last loss."""
    generator = torch.Generator().manual_seed(cfg.seed)
    teacher_rng = random.Random(cfg.seed)

    def next_batch() -> dict[str, Tensor]:
        indices = torch.randint(len(task.train), (cfg.batch_size,), generator=generator)
        examples = [task.example("train", i) for i in indices.tolist()]
        answers = [
            str(sloppy_label(e.label, cfg.correct_prob, cfg.favourite, teacher_rng) + 1)
            for e in examples
        ]
        return supervised_media_batch(processor, examples, answers)

    return fit_supervised(model, cfg, next_batch, log_every_steps=25)


def supervised_media_batch(
    processor: MediaProcessor, examples: Sequence[MediaExample], answers: Sequence[str]
) -> dict[str, Tensor]:
    """Model kwargs of right-padded ``prompt + answer + EOS`` rows with their media; labels
    are -100 except on answer + EOS."""
    tokenizer = processor.tokenizer
    rows, label_rows, media = [], [], []
    for example, answer in zip(examples, answers, strict=True):
        processed = processor.process(example.messages, example.images, example.audio)
        answer_ids = [
            *tokenizer(answer, add_special_tokens=False)["input_ids"],
            tokenizer.eos_token_id,
        ]
        rows.append(processed.prompt_ids + answer_ids)
        label_rows.append([-100] * len(processed.prompt_ids) + answer_ids)
        media.append(processed.inputs)
    length = max(map(len, rows))
    input_ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, (row, label_row) in enumerate(zip(rows, label_rows, strict=True)):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor(label_row)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        **collate_media(media),
    }


def policy_warm_start(task_name: str) -> WarmStart:
    """The warm start of a run's tiny media policy on ``task_name``: its family from
    ``model.architecture``, its arch from ``model.arch``; the default recipe of the task."""

    def warm_start(model_cfg: ModelConfig, data_cfg: DataConfig, cache_dir: Path) -> Path:
        family = media_family(model_cfg.architecture)
        return media_warm_start(family, task_name, cache_dir, arch=model_cfg.arch)

    return warm_start


def media_rows(task_name: str) -> Rows:
    """The rows of ``task_name`` (``data.eval_size`` held out)."""

    def rows(data_cfg: DataConfig, split: str, split_seed: int) -> Sequence[Mapping[str, Any]]:
        task = MediaTask(task_name, data_cfg.eval_size, split_seed)
        return task.train if split == "train" else task.eval

    return rows


SHAPES = Task(
    name="shapes",
    data_kind="media_task",
    warm_start=policy_warm_start("shapes"),
    reward="exact_match",
    rows=media_rows("shapes"),
)
PITCH = Task(
    name="pitch",
    data_kind="media_task",
    warm_start=policy_warm_start("pitch"),
    reward="exact_match",
    rows=media_rows("pitch"),
)
