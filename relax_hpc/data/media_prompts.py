"""A dataset row's media, decoded and processed into the prompt the model sees; bad rows
counted and skipped.

``MediaPrompts.process(row, index, prompt)`` reads the row's image (and audio) column with
``media.decode.decode_row_media`` (bytes, ``{bytes, path}`` structs, paths relative to the
dataset file's folder, one item or a list), optionally blanks every item (``data.blank_media``:
the control run, each image replaced by a uniform grey image of the same size and each clip
by silence of the same length), and hands prompt and media to ``MediaProcessor.process``:
the rendered text, token ids with every media pad expanded, and the ``MediaPayload``.

A row whose media cannot be used (``MediaError``: unreadable, over a limit, slot count not
matching the media) is skipped: ``process`` returns None, the row is logged with its split,
file and reason, and counted in ``skipped_rows``. It is remembered, so a later epoch does not
decode it again. Never raises for bad media: one broken image must not stop a worker.

Must not: tokenize text-only rows (``datasets`` does), or shuffle (``sampler`` does).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from relax_hpc.config.schema import DataConfig
from relax_hpc.media.decode import MediaColumns, MediaLimits, decode_row_media
from relax_hpc.media.errors import MediaError
from relax_hpc.media.processor import MediaProcessor, ProcessedPrompt

log = logging.getLogger(__name__)

BLANK_LEVEL = 128  # the grey of a blanked image (as the shapes task's blank control)


@dataclass(frozen=True)
class MediaSettings:
    """How a split reads media: the columns, the limits, the control, the files' folder."""

    columns: MediaColumns
    limits: MediaLimits
    blank: bool = False
    base_dir: Path | None = None  # relative media paths are resolved against it
    source: str = "rows"  # the data file (or task) named in logs


def media_settings(
    data_cfg: DataConfig,
    processor: MediaProcessor,
    image_key: str | None,
    data_path: str | Path | None,
) -> MediaSettings:
    """The settings ``data_cfg`` asks for; only the modalities ``processor`` takes are read."""
    columns = MediaColumns(
        image_key=image_key if processor.image_processor is not None else None,
        audio_key=data_cfg.audio_key if processor.feature_extractor is not None else None,
    )
    limits = MediaLimits(
        max_bytes=data_cfg.max_media_bytes,
        max_image_pixels=data_cfg.max_image_pixels,
        max_audio_s=data_cfg.max_audio_s,
    )
    base_dir = Path(data_path).resolve().parent if data_path else None
    source = str(data_path) if data_path else f"data.kind={data_cfg.kind}"
    return MediaSettings(columns, limits, data_cfg.blank_media, base_dir, source)


class MediaPrompts:
    """Rows of one split -> processed prompts with media, or None for a skipped row."""

    def __init__(self, processor: MediaProcessor, settings: MediaSettings, split: str) -> None:
        self.processor = processor
        self.settings = settings
        self.split = split
        self.skipped_rows: dict[int, str] = {}  # row index -> why it was skipped

    def process(
        self,
        row: Mapping[str, Any],
        index: int,
        prompt: str | Sequence[Mapping[str, Any]],
        system_prompt: str | None,
        apply_chat_template: bool,
    ) -> ProcessedPrompt | None:
        if index in self.skipped_rows:
            return None
        s = self.settings
        try:
            images, audio = decode_row_media(
                row,
                s.columns,
                sampling_rate_hz=self.processor.sampling_rate_hz,
                base_dir=s.base_dir,
                limits=s.limits,
                row_index=index,
            )
            if s.blank:
                images, audio = blank_media(images, audio)
            return self.processor.process(
                prompt,
                images,
                audio,
                system_prompt=system_prompt,
                apply_chat_template=apply_chat_template,
                where=f"row {index}",
            )
        except MediaError as error:
            self.skipped_rows[index] = str(error)
            log.warning(
                "data: %s split, %s: row %d skipped (%d so far): %s",
                self.split,
                s.source,
                index,
                len(self.skipped_rows),
                error,
            )
            return None


def blank_media(
    images: Sequence[Image.Image], audio: Sequence[np.ndarray]
) -> tuple[list[Image.Image], list[np.ndarray]]:
    """The control's media: each image a uniform grey of its size, each clip silence."""
    grey = (BLANK_LEVEL,) * 3
    return (
        [Image.new("RGB", image.size, grey) for image in images],
        [np.zeros_like(clip) for clip in audio],
    )
