"""Helpers shared by the media tests.

A uniquely named module, not a ``conftest.py``: a second ``conftest`` module would shadow
the one other tests import by that name.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import soundfile
import torch
from PIL import Image

from relax_hpc.models.multimodal import build_tiny_media_model


@functools.cache
def tiny(family: str):
    """(model, processor) of a tiny model of ``family``, built once per test process; tests
    must leave it as they found it (no optimiser steps, gradients zeroed)."""
    return build_tiny_media_model(family, seed=1)


def random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def tone(seconds: float, frequency_hz: float = 440.0, rate_hz: int = 16000) -> np.ndarray:
    t_s = np.arange(int(seconds * rate_hz)) / rate_hz
    return (0.3 * np.sin(2 * np.pi * frequency_hz * t_s)).astype(np.float32)


def png(array: np.ndarray, mode: str | None = None) -> bytes:
    buffer = io.BytesIO()
    image = Image.fromarray(array)
    (image.convert(mode) if mode else image).save(buffer, format="PNG")
    return buffer.getvalue()


def encoded_audio(samples: np.ndarray, rate_hz: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate_hz, format=fmt, subtype=subtype)
    return buffer.getvalue()


def left_padded(processor, processed) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask of processed prompts (as engines batch them)."""
    length = max(len(p.prompt_ids) for p in processed)
    ids = torch.full((len(processed), length), processor.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(processed):
        ids[row, length - len(p.prompt_ids) :] = torch.tensor(p.prompt_ids)
        mask[row, length - len(p.prompt_ids) :] = 1
    return ids, mask
