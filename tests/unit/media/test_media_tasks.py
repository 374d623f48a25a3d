"""The media tasks: deterministic, balanced, answers in the media, and a blank control that
differs from the task only in the media."""

from __future__ import annotations

import random

import numpy as np
import pytest

from relax_hpc.data.media_tasks import PITCHES_HZ, SAMPLE_RATE_HZ, MediaTask, sloppy_label
from relax_hpc.media.decode import decode_audio, decode_images


@pytest.mark.parametrize("name", ["shapes", "pitch"])
def test_rows_are_deterministic_balanced_and_decode_to_the_examples(name):
    task, again = MediaTask(name, eval_size=8), MediaTask(name, eval_size=8)
    assert [r["answer"] for r in task.eval] == ["1", "2", "3", "4"] * 2
    assert task.eval[5] == again.eval[5] and task.train[123] == again.train[123]
    key = "images" if name == "shapes" else "audio"
    other_seed = MediaTask(name, eval_size=8, split_seed=1)
    assert task.eval[5][key] != other_seed.eval[5][key]
    assert task.eval[5][key] != task.train[5][key]  # splits draw different media
    for index in (0, 3):
        row, example = task.row("eval", index), task.example("eval", index)
        assert row["prompt"] == example.messages
        if name == "shapes":
            (decoded,) = decode_images(row["images"])
            assert np.array_equal(np.asarray(decoded), example.images[0])
        else:
            (decoded,) = decode_audio(row["audio"], sampling_rate_hz=SAMPLE_RATE_HZ)
            assert np.array_equal(decoded, example.audio[0])


def test_the_shapes_image_shows_as_many_shapes_as_the_answer_says():
    task = MediaTask("shapes", eval_size=64)
    for index in range(64):
        example = task.example("eval", index)
        bright = example.images[0].min(axis=2) >= 144  # shapes >= 144, background < 48
        quadrants = [bright[r : r + 32, c : c + 32].any() for r in (0, 32) for c in (0, 32)]
        assert sum(quadrants) == example.label + 1 == int(example.answer)


def test_the_pitch_clip_holds_the_answers_tone():
    task = MediaTask("pitch", eval_size=64)
    for index in range(64):
        example = task.example("eval", index)
        spectrum = np.abs(np.fft.rfft(example.audio[0]))
        peak_hz = np.fft.rfftfreq(len(example.audio[0]), 1 / SAMPLE_RATE_HZ)[spectrum.argmax()]
        assert abs(peak_hz / PITCHES_HZ[example.label] - 1) < 0.1


@pytest.mark.parametrize("name", ["shapes", "pitch"])
def test_blank_control_differs_only_in_the_media(name):
    task, blank = MediaTask(name, eval_size=8), MediaTask(name, eval_size=8, blank=True)
    key = "images" if name == "shapes" else "audio"
    for index in range(8):
        row, control = task.row("eval", index), blank.row("eval", index)
        assert {k: v for k, v in row.items() if k not in (key, "blank")} == {
            k: v for k, v in control.items() if k not in (key, "blank")
        }
        assert control["blank"] and not row["blank"] and row[key] != control[key]
    blank_media = blank.example("eval", 2)
    if name == "shapes":
        assert (blank_media.images[0] == 128).all() and blank_media.images[0].shape == (64, 64, 3)
    else:
        assert not blank_media.audio[0].any() and blank_media.audio[0].shape == (16000,)
    assert len({blank.row("eval", i)[key][0]["bytes"] for i in range(8)}) == 1


def test_sloppy_teacher_answers_right_at_its_rate_else_its_favourite():
    rng = random.Random(0)
    labels = [sloppy_label(2, 0.4, 0, rng) for _ in range(4000)]
    assert set(labels) == {0, 2}
    assert labels.count(2) / 4000 == pytest.approx(0.4, abs=0.03)


def test_bad_task_settings_are_refused():
    with pytest.raises(ValueError, match="unknown task"):
        MediaTask("colours")
    with pytest.raises(ValueError, match="multiple of 4"):
        MediaTask("pitch", eval_size=6)
