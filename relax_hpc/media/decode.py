"""Decode a row's media values into RGB images and mono float32 waveforms, within limits.

A media value is one item or a list of items. An item is encoded bytes, a path (relative
paths are resolved against the dataset's folder), or a mapping ``{"bytes": ..., "path": ...}``
as Hugging Face datasets and Parquet files store images and audio (``bytes`` wins when both
are set). Already decoded items pass too: a ``PIL.Image`` or a uint8 array for images, a
mapping ``{"array": ..., "sampling_rate": ...}`` for audio. Audio is read with ``soundfile``
(WAV, FLAC, OGG, ...), mixed down to mono and resampled to the feature extractor's rate.

Every failure raises ``MediaError`` naming the row, the key and the fix, so the caller can
count and skip the row. Must not: fetch URLs, or know about tokens and processors.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile
from PIL import Image

from relax_hpc.media.errors import MediaError, item_label

ItemSource = bytes | Image.Image | np.ndarray | dict[str, Any]


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on one media item, checked before it is fully decoded where possible."""

    max_bytes: int = 64 * 2**20  # encoded size of one item (file or bytes)
    max_image_pixels: int = 40_000_000  # width x height of a source image
    max_audio_s: float = 30.0  # duration of one clip

    def __post_init__(self) -> None:
        if self.max_bytes <= 0 or self.max_image_pixels <= 0 or self.max_audio_s <= 0:
            raise ValueError(f"media limits must be positive, got {self}")


@dataclass(frozen=True)
class MediaColumns:
    """Which keys of a row hold its images and its audio (None: the modality is not read)."""

    image_key: str | None = "images"
    audio_key: str | None = "audio"


def decode_row_media(
    row: Mapping[str, Any],
    columns: MediaColumns,
    *,
    sampling_rate_hz: int,
    base_dir: str | Path | None = None,
    limits: MediaLimits = MediaLimits(),
    row_index: int | None = None,
) -> tuple[list[Image.Image], list[np.ndarray]]:
    """A row's images and clips; a missing or null column is no media of that kind."""
    images, audio = [], []
    if columns.image_key is not None:
        images = decode_images(
            row.get(columns.image_key),
            base_dir=base_dir,
            limits=limits,
            row=row_index,
            key=columns.image_key,
        )
    if columns.audio_key is not None:
        audio = decode_audio(
            row.get(columns.audio_key),
            sampling_rate_hz=sampling_rate_hz,
            base_dir=base_dir,
            limits=limits,
            row=row_index,
            key=columns.audio_key,
        )
    return images, audio


def media_items(value: Any) -> list[Any]:
    """A media value as a list of items (``None`` is no media)."""
    if value is None:
        return []
    if isinstance(value, list | tuple):
        return list(value)
    return [value]


def decode_images(
    value: Any,
    *,
    base_dir: str | Path | None = None,
    limits: MediaLimits = MediaLimits(),
    row: int | str | None = None,
    key: str | None = None,
) -> list[Image.Image]:
    """Every image of ``value`` as an RGB ``PIL.Image`` (transparency composited on white)."""
    images = []
    for index, item in enumerate(media_items(value)):
        where = item_label(row, key, index)
        source = _load_item(item, base_dir, limits, where, decoded_types=(Image.Image, np.ndarray))
        images.append(_to_rgb(_open_image(source, limits, where)))
    return images


def decode_audio(
    value: Any,
    *,
    sampling_rate_hz: int,
    base_dir: str | Path | None = None,
    limits: MediaLimits = MediaLimits(),
    row: int | str | None = None,
    key: str | None = None,
) -> list[np.ndarray]:
    """Every clip of ``value`` as float32 mono ``(T,)`` at ``sampling_rate_hz``."""
    clips = []
    for index, item in enumerate(media_items(value)):
        where = item_label(row, key, index)
        source = _load_item(item, base_dir, limits, where, decoded_types=())
        waveform, rate_hz = _read_audio(source, limits, where)
        if not np.isfinite(waveform).all():
            raise MediaError(where, "audio holds NaN or infinite samples", "re-encode the clip")
        clips.append(resample(waveform, rate_hz, sampling_rate_hz))
    return clips


def _load_item(
    item: Any,
    base_dir: str | Path | None,
    limits: MediaLimits,
    where: str,
    decoded_types: tuple[type, ...],
) -> ItemSource:
    """Encoded bytes of ``item`` (read from its path if need be), or a decoded item as is."""
    if decoded_types and isinstance(item, decoded_types):
        return item
    if isinstance(item, Mapping):
        if item.get("array") is not None and not decoded_types:
            return dict(item)  # decoded audio: {"array", "sampling_rate"}
        if item.get("bytes") is not None:
            return _checked_bytes(item["bytes"], limits, where)
        if item.get("path") is not None:
            return _read_path(item["path"], base_dir, limits, where)
        raise MediaError(
            where,
            f"a media mapping needs 'bytes' or 'path', got keys {sorted(item)}",
            "store the encoded file under 'bytes' or its path under 'path'",
        )
    if isinstance(item, bytes | bytearray | memoryview):
        return _checked_bytes(item, limits, where)
    if isinstance(item, str | os.PathLike):
        return _read_path(item, base_dir, limits, where)
    raise MediaError(
        where,
        f"cannot read a media item of type {type(item).__name__}",
        "use encoded bytes, a path, or {'bytes': ..., 'path': ...}",
    )


def _checked_bytes(data: bytes | bytearray | memoryview, limits: MediaLimits, where: str) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):  # e.g. a JSONL string
        raise MediaError(
            where,
            f"'bytes' holds a {type(data).__name__}, not encoded bytes",
            "store the file under 'path' (JSON has no bytes), or write the rows as Parquet",
        )
    if len(data) > limits.max_bytes:
        raise MediaError(
            where,
            f"{len(data)} bytes exceed the limit of {limits.max_bytes}",
            "shrink the file or raise the media max_bytes limit",
        )
    if len(data) == 0:
        raise MediaError(where, "the media bytes are empty", "fix or drop the row")
    return bytes(data)


def _read_path(
    path: str | os.PathLike, base_dir: str | Path | None, limits: MediaLimits, where: str
) -> bytes:
    if str(path).startswith(("http://", "https://", "s3://", "gs://")):
        raise MediaError(
            where,
            f"{path} is a URL; media are never downloaded",
            "download the file next to the dataset and store its relative path",
        )
    full = Path(path) if base_dir is None else Path(base_dir) / path
    if not full.is_file():
        raise MediaError(
            where,
            f"file {full} does not exist",
            "store paths relative to the dataset file's folder, or embed the bytes",
        )
    size = full.stat().st_size
    if size > limits.max_bytes:
        raise MediaError(
            where,
            f"file {full} has {size} bytes, over the limit of {limits.max_bytes}",
            "shrink the file or raise the media max_bytes limit",
        )
    return _checked_bytes(full.read_bytes(), limits, where)


def _open_image(source: ItemSource, limits: MediaLimits, where: str) -> Image.Image:
    if isinstance(source, np.ndarray):
        source = _array_to_image(source, where)
    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits, where)
        return source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(source))
            _check_pixels(image.size, limits, where)  # before the pixels are decoded
            image.load()
    except MediaError:
        raise
    except (
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as error:
        raise MediaError(
            where,
            f"not a readable image ({type(error).__name__}: {error})",
            "re-encode it as PNG or JPEG, or drop the row",
        ) from None
    return image


def _array_to_image(array: np.ndarray, where: str) -> Image.Image:
    if (
        array.dtype != np.uint8
        or array.ndim not in (2, 3)
        or (array.ndim == 3 and array.shape[2] not in (1, 3, 4))
    ):
        raise MediaError(
            where,
            f"an image array must be uint8 (H, W[, 1|3|4]), got {array.dtype} {array.shape}",
            "store encoded image bytes instead",
        )
    return Image.fromarray(array[..., 0] if array.ndim == 3 and array.shape[2] == 1 else array)


def _check_pixels(size: tuple[int, int], limits: MediaLimits, where: str) -> None:
    width, height = size
    if width * height > limits.max_image_pixels:
        raise MediaError(
            where,
            f"{width}x{height} pixels exceed the limit of {limits.max_image_pixels}",
            "downscale the image or raise the media max_image_pixels limit",
        )
    if width == 0 or height == 0:
        raise MediaError(where, f"the image is empty ({width}x{height})", "drop the row")


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white (what a viewer shows), not black."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def _read_audio(source: ItemSource, limits: MediaLimits, where: str) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate; the duration is checked before decoding."""
    if isinstance(source, dict):
        samples = np.asarray(source["array"], dtype=np.float32)
        rate_hz = int(source.get("sampling_rate") or 0)
        if rate_hz <= 0:
            raise MediaError(where, "decoded audio has no sampling_rate", "add 'sampling_rate'")
        if samples.ndim == 2:
            samples = samples.mean(axis=1 if samples.shape[0] > samples.shape[1] else 0)
        _check_duration(samples.shape[0], rate_hz, limits, where)
        return samples, rate_hz
    _check_wav_complete(source, where)
    try:
        with soundfile.SoundFile(io.BytesIO(source)) as handle:
            _check_duration(handle.frames, handle.samplerate, limits, where)
            samples = handle.read(dtype="float32", always_2d=True)
            rate_hz = handle.samplerate
    except MediaError:
        raise
    except (RuntimeError, ValueError, TypeError, OSError) as error:
        raise MediaError(
            where,
            f"not a readable audio file ({type(error).__name__}: {error})",
            "re-encode it as WAV or FLAC, or drop the row",
        ) from None
    return samples.mean(axis=1, dtype=np.float32), rate_hz


def _check_wav_complete(data: bytes, where: str) -> None:
    """A RIFF/WAVE file must hold the bytes its ``data`` chunk declares: libsndfile reads
    a truncated WAV without an error, as a shorter clip (a cut-off upload or copy)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    offset = 12
    while offset + 8 <= len(data):
        chunk, size = (
            data[offset : offset + 4],
            int.from_bytes(data[offset + 4 : offset + 8], "little"),
        )
        if chunk == b"data":
            present = len(data) - offset - 8
            if size not in (0, 0xFFFFFFFF) and present < size:  # 0/max: a streamed WAV
                raise MediaError(
                    where,
                    f"truncated WAV: its data chunk declares {size} bytes, {present} are present",
                    "re-export the clip, or drop the row",
                )
            return
        offset += 8 + size + (size & 1)  # chunks are padded to even sizes


def _check_duration(num_frames: int, rate_hz: int, limits: MediaLimits, where: str) -> None:
    seconds = num_frames / rate_hz
    if seconds > limits.max_audio_s:
        raise MediaError(
            where,
            f"{seconds:.2f} s of audio exceed the limit of {limits.max_audio_s} s",
            "trim the clip or raise the media max_audio_s limit",
        )
    if num_frames == 0:
        raise MediaError(where, "the audio clip is empty", "drop the row")


def resample(
    waveform: np.ndarray, from_hz: int, to_hz: int, chunk_frames: int = 1 << 15
) -> np.ndarray:
    """Band-limited resampling (windowed sinc, Hann window, 6 zero crossings, rolloff 0.99).

    The algorithm of ``torchaudio.functional.resample`` in numpy: a bank of ``new`` kernels
    applied with stride ``orig`` for the rate ratio ``new/orig`` in lowest terms. Output
    length is ``ceil(len * to_hz / from_hz)``. Deterministic (float64 kernels, chunked).
    """
    waveform = np.ascontiguousarray(waveform, dtype=np.float32)
    if from_hz == to_hz:
        return waveform
    divisor = math.gcd(int(from_hz), int(to_hz))
    orig, new = int(from_hz) // divisor, int(to_hz) // divisor
    kernels_NK, width = _sinc_kernels(orig, new)
    padded = np.pad(waveform.astype(np.float64), (width, width + orig))
    frames_FK = np.lib.stride_tricks.sliding_window_view(padded, kernels_NK.shape[1])[::orig]
    pieces = [
        frames_FK[start : start + chunk_frames] @ kernels_NK.T
        for start in range(0, frames_FK.shape[0], chunk_frames)
    ]
    target_length = math.ceil(new * waveform.shape[0] / orig)
    return np.concatenate(pieces).reshape(-1)[:target_length].astype(np.float32)


def _sinc_kernels(
    orig: int, new: int, zero_crossings: int = 6, rolloff: float = 0.99
) -> tuple[np.ndarray, int]:
    base_freq = min(orig, new) * rolloff
    width = math.ceil(zero_crossings * orig / base_freq)
    offsets_K = np.arange(-width, width + orig, dtype=np.float64) / orig
    times_NK = (np.arange(0, -new, -1, dtype=np.float64)[:, None] / new + offsets_K) * base_freq
    times_NK = np.clip(times_NK, -zero_crossings, zero_crossings)
    window_NK = np.cos(times_NK * math.pi / zero_crossings / 2) ** 2
    times_NK = times_NK * math.pi
    safe_NK = np.where(times_NK == 0, 1.0, times_NK)
    sinc_NK = np.where(times_NK == 0, 1.0, np.sin(safe_NK) / safe_NK)
    return sinc_NK * window_NK * (base_freq / orig), width
