"""The compact, serialisable media of one prompt: what the spool stores once per group.

A payload holds the processor's *inputs*, not its outputs: images already resized to the
size the image processor would pick (uint8, so a re-run of the processor leaves them as they
are) and clips as float32 mono at the feature extractor's rate. That is ~20x smaller than
pixel values (2 temporal copies in float32) and far smaller than Whisper features (padded to
the feature extractor's chunk). ``MediaProcessor.model_inputs(payload)`` rebuilds the model
inputs bit-identically on any machine; ``fingerprint`` names the processor configuration
the payload was made for, and a processor with another one refuses it.

Must not: import torch, or know how the spool lays arrays out (``to_arrays`` hands it a flat
mapping of numpy arrays and a JSON-able ``meta``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class MediaPayload:
    images: tuple[np.ndarray, ...]  # uint8 (H, W, 3), at the processor's size
    audio: tuple[np.ndarray, ...]  # float32 (T,), at sampling_rate_hz
    sampling_rate_hz: int
    fingerprint: str  # MediaProcessor.fingerprint of the processor that fitted them

    def __post_init__(self) -> None:
        for image in self.images:
            assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        for clip in self.audio:
            assert clip.dtype == np.float32 and clip.ndim == 1

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for a in (*self.images, *self.audio))

    @property
    def is_empty(self) -> bool:
        return not self.images and not self.audio

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Flat arrays (``image/values``, ``image/shapes``, ``audio/values``,
        ``audio/lengths``) and JSON-able metadata; ``from_arrays`` inverts it exactly."""
        shapes = np.asarray([i.shape for i in self.images], dtype=np.int64).reshape(-1, 3)
        arrays = {
            "image/values": _concat([i.reshape(-1) for i in self.images], np.uint8),
            "image/shapes": shapes,
            "audio/values": _concat(list(self.audio), np.float32),
            "audio/lengths": np.asarray([len(c) for c in self.audio], dtype=np.int64),
        }
        meta = {"sampling_rate_hz": self.sampling_rate_hz, "fingerprint": self.fingerprint}
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> MediaPayload:
        shapes = np.asarray(arrays["image/shapes"], dtype=np.int64).reshape(-1, 3)
        sizes = [int(np.prod(s)) for s in shapes]
        flat_images = _split(np.asarray(arrays["image/values"], dtype=np.uint8), sizes)
        lengths = [int(n) for n in np.asarray(arrays["audio/lengths"], dtype=np.int64)]
        clips = _split(np.asarray(arrays["audio/values"], dtype=np.float32), lengths)
        return cls(
            images=tuple(f.reshape(tuple(s)) for f, s in zip(flat_images, shapes, strict=True)),
            audio=tuple(clips),
            sampling_rate_hz=int(meta["sampling_rate_hz"]),
            fingerprint=str(meta["fingerprint"]),
        )


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)


def _split(values: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    if sum(sizes) != values.shape[0]:
        raise ValueError(f"media payload: {values.shape[0]} values for item sizes {sizes}")
    offsets = np.cumsum([0, *sizes])
    return [values[offsets[i] : offsets[i + 1]].copy() for i in range(len(sizes))]
