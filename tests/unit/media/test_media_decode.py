"""Decoding media values of dataset rows: every stored form, limits, and clear errors."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from media_fixtures import encoded_audio, png, random_image, tone
from PIL import Image

from relax_hpc.media.decode import (
    MediaColumns,
    MediaLimits,
    decode_audio,
    decode_images,
    decode_row_media,
    resample,
)
from relax_hpc.media.errors import MediaError


def test_images_decode_from_bytes_paths_hf_mappings_and_lists(tmp_path):
    first, second = random_image(20, 30, seed=1), random_image(8, 8, seed=2)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "b.png").write_bytes(png(second))
    value = [
        png(first),
        "pics/b.png",
        {"bytes": None, "path": "pics/b.png"},
        {"bytes": png(first), "path": "ignored.png"},
    ]
    images = decode_images(value, base_dir=tmp_path)
    assert [i.mode for i in images] == ["RGB"] * 4
    for image, expected in zip(images, [first, second, second, first], strict=True):
        assert np.array_equal(np.asarray(image), expected)
    assert decode_images(None) == []
    single = decode_images({"bytes": png(first)})
    assert len(single) == 1 and np.array_equal(np.asarray(single[0]), first)


def test_images_become_rgb_with_transparency_on_white():
    rgba = np.zeros((4, 4, 4), np.uint8)
    rgba[..., 0] = 255
    rgba[:2, :, 3] = 255  # top half opaque red, bottom half fully transparent
    (image,) = decode_images(png(rgba))
    pixels = np.asarray(image)
    assert (pixels[:2] == [255, 0, 0]).all() and (pixels[2:] == [255, 255, 255]).all()
    (gray,) = decode_images(png(random_image(5, 5), mode="L"))
    assert gray.mode == "RGB"
    (from_array,) = decode_images(random_image(3, 4))
    assert from_array.size == (4, 3)


def test_audio_decodes_wav_flac_and_decoded_arrays_to_mono_at_the_target_rate():
    stereo = np.stack([tone(0.5, 440.0, 44100), tone(0.5, 440.0, 44100)], axis=1)
    wav, flac = encoded_audio(stereo, 44100, "WAV"), encoded_audio(stereo, 44100, "FLAC")
    clips = decode_audio(
        [
            wav,
            {"bytes": flac, "path": None},
            {"array": stereo[:, 0].tolist(), "sampling_rate": 44100},
        ],
        sampling_rate_hz=16000,
    )
    for clip in clips:
        assert clip.dtype == np.float32 and clip.shape == (8000,)
        np.testing.assert_allclose(clip[200:-200], tone(0.5)[200:-200], atol=2e-3)
    float_wav = encoded_audio(tone(0.25), 16000, "WAV", subtype="FLOAT")
    (same_rate,) = decode_audio(float_wav, sampling_rate_hz=16000)
    assert np.array_equal(same_rate, tone(0.25))


def test_resampling_is_band_limited_and_sized_like_torchaudio():
    for from_hz, to_hz in [(44100, 16000), (8000, 16000), (48000, 16000), (22050, 16000)]:
        source = tone(0.3, 1000.0, from_hz)
        out = resample(source, from_hz, to_hz)
        assert out.shape == (math.ceil(len(source) * to_hz / from_hz),)
        edge = 64
        np.testing.assert_allclose(out[edge:-edge], tone(0.3, 1000.0, to_hz)[edge:-edge], atol=3e-3)
    # Above the new Nyquist frequency a tone is filtered out, not folded back.
    aliased = resample(tone(0.3, 11000.0, 44100), 44100, 16000)
    assert np.abs(aliased[100:-100]).max() < 0.01


def _hit(value, **kwargs) -> MediaError:
    decode = decode_audio if "sampling_rate_hz" in kwargs else decode_images
    with pytest.raises(MediaError) as caught:
        decode(value, row=7, key="media", **kwargs)
    return caught.value


def test_bad_images_name_the_row_the_key_and_the_fix(tmp_path):
    error = _hit([png(random_image(4, 4)), b"not an image"])
    assert str(error).startswith("row 7, key 'media'[1]: not a readable image")
    assert "re-encode" in error.fix
    assert "does not exist" in _hit("missing.png", base_dir=tmp_path).reason
    assert "never downloaded" in _hit("https://example.org/cat.png").reason
    assert (
        "bytes exceed" in _hit(png(random_image(64, 64)), limits=MediaLimits(max_bytes=100)).reason
    )
    big = io.BytesIO()
    Image.new("1", (5000, 5000)).save(big, format="PNG")  # a few kB, 25 M pixels
    error = _hit(big.getvalue(), limits=MediaLimits(max_image_pixels=10_000_000))
    assert "5000x5000 pixels exceed" in error.reason and "max_image_pixels" in error.fix
    assert "empty" in _hit(b"").reason
    assert "needs 'bytes' or 'path'" in _hit({"url": "x"}).reason
    assert "cannot read" in _hit(3.5).reason


def test_bad_audio_names_the_row_the_key_and_the_fix():
    long_clip = encoded_audio(tone(3.0), 16000, "WAV")
    error = _hit(long_clip, sampling_rate_hz=16000, limits=MediaLimits(max_audio_s=2.0))
    assert "3.00 s of audio exceed the limit of 2.0 s" in error.reason
    assert "max_audio_s" in error.fix
    assert "not a readable audio" in _hit(b"RIFF....WAVE", sampling_rate_hz=16000).reason
    nan_clip = tone(0.1)
    nan_clip[5] = np.nan
    nan_wav = encoded_audio(nan_clip, 16000, "WAV", subtype="FLOAT")
    assert "NaN" in _hit(nan_wav, sampling_rate_hz=16000).reason
    assert "sampling_rate" in _hit({"array": [0.0, 1.0]}, sampling_rate_hz=16000).reason


def test_a_rows_media_columns_decode_together(tmp_path):
    (tmp_path / "a.wav").write_bytes(encoded_audio(tone(0.5), 16000, "WAV"))
    row = {"prompt": "<image><audio>", "pics": [png(random_image(4, 4))], "sound": "a.wav"}
    images, audio = decode_row_media(
        row, MediaColumns("pics", "sound"), sampling_rate_hz=16000, base_dir=tmp_path
    )
    assert len(images) == 1
    np.testing.assert_allclose(audio[0], tone(0.5), atol=1e-4)  # 16-bit WAV
    assert decode_row_media({"prompt": "x"}, MediaColumns(), sampling_rate_hz=16000) == ([], [])
    with pytest.raises(MediaError, match="row 4, key 'sound'\\[0\\]: file .* does not exist"):
        decode_row_media(
            {"sound": ["b.wav"]},
            MediaColumns(None, "sound"),
            sampling_rate_hz=16000,
            base_dir=tmp_path,
            row_index=4,
        )
