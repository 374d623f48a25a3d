"""Built-in synthetic tasks whose answers depend on the media, so a blind model cannot beat
chance: the proof that images and audio flow through the whole engine.

``shapes`` (visual): a 64x64 image with 1 to 4 bright filled shapes (squares, discs,
triangles of random sizes and colours) on a dark background, each in its own quadrant; the
answer is their number. (Locating one shape was not learnable in minutes: the tiny model's
attention must read *where* a token sits, which rotary positions do not put into values;
counting only needs to pool over the image tokens.) ``pitch`` (audio):
1 s of 16 kHz audio with one tone (random onset, length, loudness, +-8% detune, light noise)
at one of four pitches an octave apart (250 Hz .. 2 kHz); the answer is ``1`` (lowest) ..
``4``. Example ``i`` of a split has class ``i % 4``, so every class is equally frequent and
any constant answer scores 25%. Everything else is a pure function of (task, split_seed,
split, index). The ``blank`` control has the same prompts and answers with the media replaced
by a uniform grey image or silence of the same length: no model can beat chance on it.

Rows use the schema a dataset file would: ``prompt`` holds chat messages with typed parts,
``images`` / ``audio`` a list of ``{"bytes": <PNG or 16-bit WAV>, "path": None}`` as Hugging
Face datasets store them. ``example(split, i)`` gives the decoded media directly (equal to
decoding the row's bytes: PNG is lossless and the clips are generated on the 16-bit grid).

The *sloppy teacher* of the warm start answers right with probability ``correct_prob`` and
otherwise with its favourite class; a model converged on it answers the favourite whenever
``correct_prob < 0.5`` (greedy accuracy near chance) but samples the right answer often.

Must not: import torch, a tokenizer or a processor.
"""

from __future__ import annotations

import io
import random
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
from PIL import Image, ImageDraw

NUM_CLASSES = 4
IMAGE_SIZE_PX = 64
SAMPLE_RATE_HZ = 16000
CLIP_S = 1.0
PITCHES_HZ = (250.0, 500.0, 1000.0, 2000.0)
PROMPTS = {"shapes": "How many shapes? (1-4)", "pitch": "Which pitch? (1-4)"}
MODALITIES = {"shapes": "image", "pitch": "audio"}
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class MediaExample:
    messages: list[dict[str, Any]]
    images: list[np.ndarray]  # uint8 (H, W, 3)
    audio: list[np.ndarray]  # float32 (T,) at SAMPLE_RATE_HZ
    label: int  # 0 .. NUM_CLASSES - 1
    answer: str  # str(label + 1)


class MediaTask:
    """One task, its train and held-out splits, and the blank control (``blank=True``)."""

    def __init__(
        self,
        name: str,
        eval_size: int = 128,
        split_seed: int = 0,
        blank: bool = False,
        train_size: int = 1_000_000,
    ) -> None:
        if name not in PROMPTS:
            raise ValueError(f"data.media_task: unknown task {name!r}; use one of {list(PROMPTS)}")
        if eval_size < NUM_CLASSES or eval_size % NUM_CLASSES:
            raise ValueError(f"data.eval_size must be a positive multiple of {NUM_CLASSES}")
        self.name = name
        self.modality = MODALITIES[name]
        self.split_seed = split_seed
        self.blank = blank
        self.sizes = {"train": train_size, "eval": eval_size}
        self.train = MediaSplit(self, "train")
        self.eval = MediaSplit(self, "eval")

    def example(self, split: str, index: int) -> MediaExample:
        """Example ``index`` of ``split``, its media decoded."""
        assert split in SPLITS and 0 <= index < self.sizes[split], (split, index)
        label = index % NUM_CLASSES
        rng = np.random.default_rng(
            random.Random(f"{self.name}:{self.split_seed}:{split}:{index}").getrandbits(64)
        )
        part = {"type": self.modality}
        messages = [
            {"role": "user", "content": [part, {"type": "text", "text": PROMPTS[self.name]}]}
        ]
        if self.name == "shapes":
            image = blank_image() if self.blank else shapes_image(label, rng)
            return MediaExample(messages, [image], [], label, str(label + 1))
        clip = (
            np.zeros(int(CLIP_S * SAMPLE_RATE_HZ), np.float32)
            if self.blank
            else (pitch_clip(label, rng))
        )
        return MediaExample(messages, [], [clip], label, str(label + 1))

    def row(self, split: str, index: int) -> dict[str, Any]:
        """The example as a dataset row (media as encoded bytes)."""
        example = self.example(split, index)
        row: dict[str, Any] = {
            "prompt": example.messages,
            "answer": example.answer,
            "label": example.label,
            "task": self.name,
            "split": split,
            "index": index,
            "blank": self.blank,
        }
        if example.images:
            row["images"] = [{"bytes": png_bytes(i), "path": None} for i in example.images]
        if example.audio:
            row["audio"] = [{"bytes": wav_bytes(c), "path": None} for c in example.audio]
        return row


class MediaSplit(Sequence[dict[str, Any]]):
    """One split as a lazy sequence of rows."""

    def __init__(self, task: MediaTask, split: str) -> None:
        self.task = task
        self.split = split

    def __len__(self) -> int:
        return self.task.sizes[self.split]

    @overload
    def __getitem__(self, index: int) -> dict[str, Any]: ...
    @overload
    def __getitem__(self, index: slice) -> list[dict[str, Any]]: ...
    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.task.row(self.split, index % len(self))


def shapes_image(label: int, rng: np.random.Generator) -> np.ndarray:
    """``label + 1`` bright shapes on a dark background, each in its own quadrant."""
    half = IMAGE_SIZE_PX // 2
    background = tuple(int(c) for c in rng.integers(0, 48, 3))
    image = Image.new("RGB", (IMAGE_SIZE_PX, IMAGE_SIZE_PX), background)
    draw = ImageDraw.Draw(image)
    for quadrant in rng.permutation(NUM_CLASSES)[: label + 1].tolist():
        size = int(rng.integers(10, 25))
        left = (quadrant % 2) * half + int(rng.integers(1, half - size))
        top = (quadrant // 2) * half + int(rng.integers(1, half - size))
        _draw_shape(
            draw,
            int(rng.integers(0, 3)),
            (left, top, size),
            tuple(int(c) for c in rng.integers(144, 256, 3)),
        )
    return np.asarray(image, dtype=np.uint8)


def _draw_shape(
    draw: ImageDraw.ImageDraw, kind: int, place: tuple[int, int, int], fill: tuple[int, ...]
) -> None:
    left, top, size = place
    box = (left, top, left + size, top + size)
    if kind == 0:
        draw.rectangle(box, fill=fill)
    elif kind == 1:
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon(
            [(left, top + size), (left + size, top + size), (left + size // 2, top)], fill=fill
        )


def pitch_clip(label: int, rng: np.random.Generator) -> np.ndarray:
    """A tone at pitch ``label`` in 1 s of light noise, on the 16-bit grid."""
    num_samples = int(CLIP_S * SAMPLE_RATE_HZ)
    frequency_hz = PITCHES_HZ[label] * float(rng.uniform(0.92, 1.08))
    length = int(rng.uniform(0.4, 0.7) * num_samples)
    onset = int(rng.integers(0, num_samples - length))
    t_s = np.arange(length) / SAMPLE_RATE_HZ
    ramp = np.minimum(1.0, np.minimum(np.arange(length), np.arange(length)[::-1]) / 160)
    clip = rng.normal(0.0, 0.01, num_samples)
    clip[onset : onset + length] += (
        float(rng.uniform(0.2, 0.6))
        * ramp
        * np.sin(2 * np.pi * frequency_hz * t_s + float(rng.uniform(0, 2 * np.pi)))
    )
    return _on_16_bit_grid(clip)


def blank_image() -> np.ndarray:
    return np.full((IMAGE_SIZE_PX, IMAGE_SIZE_PX, 3), 128, dtype=np.uint8)


def png_bytes(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def wav_bytes(clip: np.ndarray, sample_rate_hz: int = SAMPLE_RATE_HZ) -> bytes:
    """16-bit PCM mono WAV (stdlib ``wave``)."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(sample_rate_hz)
        handle.writeframes(np.round(clip * 32768).astype("<i2").tobytes())
    return buffer.getvalue()


def sloppy_label(label: int, correct_prob: float, favourite: int, rng: random.Random) -> int:
    """The warm start's teacher: right with ``correct_prob``, else its favourite class."""
    return label if rng.random() < correct_prob else favourite


def _on_16_bit_grid(clip: np.ndarray) -> np.ndarray:
    quantised = np.clip(np.round(clip * 32768), -32768, 32767)
    return (quantised / 32768).astype(np.float32)
