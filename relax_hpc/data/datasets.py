"""Prompt datasets: local JSONL/Parquet files or the synthetic task, as ``PromptRecord``s.

The built-in tasks' rows (``synthetic_addition``, ``guess_number``, ``media_task``) come from
the task ``data.kind`` names (``tasks.registry.data_task``: e.g. ``tasks.addition``).
A row holds a prompt and a reference answer under ``data.prompt_key`` / ``data.answer_key``
(dotted keys reach into nested columns, e.g. ``reward_model.ground_truth``), as the row's
published schema (``data.schema``, ``relax_hpc.data.schemas``) lays them out. The prompt is
a string or a list of chat messages ``[{"role", "content"}]``; content may be typed parts
(``{"type": "text" | "image"}``) and a text may hold ``<image>`` marks (geo3k).

With a ``MediaProcessor`` (a vision model), the row's image column (``data.image_key``, or
the schema's) is decoded and processed with the prompt (``data.media_prompts``): the record
carries the rendered prompt with its media tokens and the ``MediaPayload`` (``media``); a
row with an unusable image is skipped, and ``dataset[i]`` is then None (the sampler draws
the next row; the eval leaves it out). Without a processor (a text model) a schema's image
bytes are kept in ``PromptRecord.images``, and nothing is decoded. With
``data.apply_chat_template`` the messages (after an optional ``data.system_prompt``) go
through the tokenizer's chat template with the generation prompt; otherwise a string prompt
is used as is. Records are built lazily, by index, so a dataset of any size costs little.

Must not: shuffle or remember a position (``sampler`` does), or read anything but local files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.media_prompts import MediaPrompts, media_settings
from relax_hpc.data.schemas import SCHEMAS
from relax_hpc.media.payload import MediaPayload
from relax_hpc.media.processor import MediaProcessor
from relax_hpc.tasks.registry import data_task

SPLITS = ("train", "eval")
FILE_KINDS = ("jsonl", "parquet")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as the model sees it, with what the reward needs."""

    prompt: str  # the text given to the model (chat template applied)
    prompt_ids: list[int]
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other columns
    images: tuple[bytes, ...] = ()  # encoded images (PNG, JPEG) of the schema's image column
    # The prompt as the row holds it (a string or chat messages), for environments that
    # render it themselves (rollout.environment); None when built by hand.
    source_prompt: Any = None
    # The prompt's fitted images/audio (a vision model's dataset); None: text only.
    media: MediaPayload | None = None


class PromptDataset(Sequence[PromptRecord | None]):
    """Rows (any sequence of mappings) turned into ``PromptRecord``s on access; None for a
    row skipped for its media (``media`` given: see ``data.media_prompts``)."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        image_key: str | None = None,
        media: MediaPrompts | None = None,
    ) -> None:
        self.rows = rows
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.system_prompt = system_prompt
        self.apply_chat_template = apply_chat_template
        self.image_key = image_key
        self.media = media
        if media is not None:
            self.image_key = media.settings.columns.image_key
        if apply_chat_template and tokenizer.chat_template is None:
            raise ValueError(
                "data.apply_chat_template: the tokenizer has no chat template; "
                "set data.apply_chat_template=false or use a tokenizer that has one"
            )

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def skipped_rows(self) -> dict[int, str]:
        """Rows skipped so far for their media (index -> reason); only rows read count."""
        return self.media.skipped_rows if self.media is not None else {}

    def __getitem__(self, index: int) -> PromptRecord | None:  # type: ignore[override]
        row = self.rows[index]
        source_prompt = _lookup(row, self.prompt_key, index)
        answer = str(_lookup(row, self.answer_key, index))
        columns = {self.prompt_key, self.answer_key, self.image_key, *self._media_keys()}
        tops = {key.split(".")[0] for key in columns if key}
        metadata = {k: v for k, v in row.items() if k not in tops}
        if self.media is not None:
            processed = self.media.process(
                row, index, source_prompt, self.system_prompt, self.apply_chat_template
            )
            if processed is None:
                return None
            return PromptRecord(
                processed.text,
                processed.prompt_ids,
                answer,
                metadata,
                source_prompt=source_prompt,
                media=None if processed.payload.is_empty else processed.payload,
            )
        text = self.prompt_text(source_prompt)
        # A chat template writes the special tokens it needs itself.
        ids = self.tokenizer(text, add_special_tokens=not self.apply_chat_template)["input_ids"]
        images = image_bytes(_lookup(row, self.image_key, index)) if self.image_key else ()
        return PromptRecord(text, list(ids), answer, metadata, images, source_prompt)

    def _media_keys(self) -> tuple[str | None, ...]:
        return (self.media.settings.columns.audio_key,) if self.media is not None else ()

    def prompt_text(self, prompt: str | Sequence[Mapping[str, str]]) -> str:
        if not self.apply_chat_template:
            if not isinstance(prompt, str):
                raise ValueError(
                    "data.apply_chat_template=false needs string prompts, got chat messages"
                )
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.system_prompt is not None:
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )

    def max_prompt_tokens(self) -> int:
        """The longest prompt in tokens (reads every record; for checks, not the hot path)."""
        records = (self[i] for i in range(len(self)))
        return max((len(r.prompt_ids) for r in records if r is not None), default=0)


def build_dataset(
    data_cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    split: str = "train",
    split_seed: int = 0,
    processor: MediaProcessor | None = None,
) -> PromptDataset:
    """The ``train`` or ``eval`` split that ``data`` describes.

    ``split_seed`` picks the synthetic tasks' held-out examples; files are split by path
    (``data.path`` / ``data.eval_path``). ``processor`` (a vision model's; its tokenizer is
    ``tokenizer``) reads the rows' media into the records.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rows = _rows(data_cfg, split, split_seed)
    schema = SCHEMAS[data_cfg.schema]
    prompt_key, answer_key = schema.keys(data_cfg.prompt_key, data_cfg.answer_key)
    media = None
    if processor is not None:
        path = None if data_cfg.kind not in FILE_KINDS else _split_path(data_cfg, split)
        image_key = schema.image_key or data_cfg.image_key
        media = MediaPrompts(processor, media_settings(data_cfg, processor, image_key, path), split)
    return PromptDataset(
        rows,
        tokenizer,
        prompt_key=prompt_key,
        answer_key=answer_key,
        system_prompt=data_cfg.system_prompt,
        apply_chat_template=data_cfg.apply_chat_template,
        image_key=schema.image_key,
        media=media,
    )


def _split_path(data_cfg: DataConfig, split: str) -> str | None:
    return data_cfg.path if split == "train" else data_cfg.eval_path


def _rows(data_cfg: DataConfig, split: str, split_seed: int) -> Sequence[Mapping[str, Any]]:
    task = data_task(data_cfg)
    if task is not None and task.rows is not None:
        return task.rows(data_cfg, split, split_seed)
    path = _split_path(data_cfg, split)
    field_name = "data.path" if split == "train" else "data.eval_path"
    if path is None:
        raise ValueError(f"{field_name}: needed for the {split} split of data.kind={data_cfg.kind}")
    if data_cfg.kind == "jsonl":
        return read_jsonl(path)
    if data_cfg.kind == "parquet":
        return read_parquet(path)
    raise ValueError(
        f"data.kind: unknown kind {data_cfg.kind!r}; use jsonl, parquet, synthetic_addition, "
        "guess_number or media_task"
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """One JSON object per non-empty line."""
    rows = []
    with open(_existing(path), encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not JSON ({error.msg})") from None
    return rows


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # only file datasets need pyarrow

    return pq.read_table(_existing(path)).to_pylist()


def _existing(path: str | Path) -> Path:
    if not Path(path).is_file():
        raise ValueError(f"data file {path} does not exist")
    return Path(path)


def image_bytes(value: Any) -> tuple[bytes, ...]:
    """An image column as encoded bytes: one image or a list, each raw bytes or the
    ``{"bytes", "path"}`` struct of a Hugging Face ``Image`` feature (bytes embedded)."""
    items = value if isinstance(value, list | tuple) else [value]
    found = []
    for item in items:
        data = item.get("bytes") if isinstance(item, Mapping) else item
        if not isinstance(data, bytes | bytearray):
            raise ValueError(
                f"an image is {type(data).__name__}, not embedded bytes; write the dataset "
                "with its images embedded (Hugging Face datasets embeds them in Parquet)"
            )
        found.append(bytes(data))
    return tuple(found)


def _lookup(row: Mapping[str, Any], dotted_key: str, index: int) -> Any:
    value: Any = row
    for part in dotted_key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise ValueError(f"row {index} has no key {dotted_key!r} (keys: {sorted(row)})")
        value = value[part]
    return value
