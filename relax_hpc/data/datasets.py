"""Prompt datasets: local JSONL/Parquet files or the synthetic task, as ``PromptRecord``s.

A row holds a prompt and a reference answer under ``data.prompt_key`` / ``data.answer_key``
(dotted keys reach into nested columns, e.g. ``reward_model.ground_truth``), as the row's
published schema (``data.schema``, ``relax_hpc.data.schemas``) lays them out; a schema with
images (geo3k) has their bytes in ``PromptRecord.images``. The prompt is a
string or a list of chat messages ``[{"role", "content"}]``. With
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
from relax_hpc.data.schemas import SCHEMAS
from relax_hpc.data.tasks import AdditionTask

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as the model sees it, with what the reward needs."""

    prompt: str  # the text given to the model (chat template applied)
    prompt_ids: list[int]
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's other columns
    images: tuple[bytes, ...] = ()  # encoded images (PNG, JPEG) of the schema's image column


class PromptDataset(Sequence[PromptRecord]):
    """Rows (any sequence of mappings) turned into ``PromptRecord``s on access."""

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        system_prompt: str | None = None,
        apply_chat_template: bool = True,
        image_key: str | None = None,
    ) -> None:
        self.rows = rows
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.system_prompt = system_prompt
        self.apply_chat_template = apply_chat_template
        self.image_key = image_key
        if apply_chat_template and tokenizer.chat_template is None:
            raise ValueError(
                "data.apply_chat_template: the tokenizer has no chat template; "
                "set data.apply_chat_template=false or use a tokenizer that has one"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRecord:  # type: ignore[override]
        row = self.rows[index]
        text = self.prompt_text(_lookup(row, self.prompt_key, index))
        # A chat template writes the special tokens it needs itself.
        ids = self.tokenizer(text, add_special_tokens=not self.apply_chat_template)["input_ids"]
        skipped = {self.prompt_key.split(".")[0], self.answer_key.split(".")[0], self.image_key}
        metadata = {k: v for k, v in row.items() if k not in skipped}
        answer = _lookup(row, self.answer_key, index)
        images = image_bytes(_lookup(row, self.image_key, index)) if self.image_key else ()
        return PromptRecord(text, list(ids), str(answer), metadata, images)

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
        return max((len(self[i].prompt_ids) for i in range(len(self))), default=0)


def build_dataset(
    data_cfg: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    split: str = "train",
    split_seed: int = 0,
) -> PromptDataset:
    """The ``train`` or ``eval`` split that ``data`` describes.

    ``split_seed`` picks the synthetic task's held-out pairs; files are split by path
    (``data.path`` / ``data.eval_path``).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rows = _rows(data_cfg, split, split_seed)
    schema = SCHEMAS[data_cfg.schema]
    prompt_key, answer_key = schema.keys(data_cfg.prompt_key, data_cfg.answer_key)
    return PromptDataset(
        rows,
        tokenizer,
        prompt_key=prompt_key,
        answer_key=answer_key,
        system_prompt=data_cfg.system_prompt,
        apply_chat_template=data_cfg.apply_chat_template,
        image_key=schema.image_key,
    )


def _rows(data_cfg: DataConfig, split: str, split_seed: int) -> Sequence[Mapping[str, Any]]:
    if data_cfg.kind == "synthetic_addition":
        task = AdditionTask(data_cfg.digits, data_cfg.eval_size, split_seed)
        return task.train if split == "train" else task.eval
    path = data_cfg.path if split == "train" else data_cfg.eval_path
    field_name = "data.path" if split == "train" else "data.eval_path"
    if path is None:
        raise ValueError(f"{field_name}: needed for the {split} split of data.kind={data_cfg.kind}")
    if data_cfg.kind == "jsonl":
        return read_jsonl(path)
    if data_cfg.kind == "parquet":
        return read_parquet(path)
    raise ValueError(
        f"data.kind: unknown kind {data_cfg.kind!r}; use jsonl, parquet or synthetic_addition"
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
