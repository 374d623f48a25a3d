"""Audio datasets for an Omni model: WAV/FLAC clips as bytes, ``{bytes, path}`` structs and
paths relative to the data file, several clips and images in one chat row, resampled to the
feature extractor's rate, and a truncated WAV skipped and counted instead of a crash."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.models.multimodal import tiny_processor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "media"))
from media_fixtures import encoded_audio, png, random_image, tone  # noqa: E402


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("qwen2_5_omni")


def pads(processor, ids, token) -> int:
    return sum(i == processor.tokenizer.convert_tokens_to_ids(token) for i in ids)


def omni_row(audio, images, content) -> dict:
    return {
        "prompt": [{"role": "user", "content": content}],
        "answer": "A",
        "audio": audio,
        "images": images,
    }


def test_images_and_several_clips_in_one_chat_row_at_the_extractor_rate(tmp_path, processor):
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.wav").write_bytes(
        encoded_audio(tone(0.5, rate_hz=44100), 44100, "WAV")
    )
    flac = encoded_audio(tone(0.75, 220.0, rate_hz=22050), 22050, "FLAC")
    content = [
        {"type": "text", "text": "Which is higher? "},
        {"type": "audio"},
        {"type": "text", "text": " or "},
        {"type": "audio"},
        {"type": "image"},
    ]
    row = omni_row(
        [{"bytes": None, "path": "clips/a.wav"}, {"bytes": flac, "path": "b.flac"}],
        [{"bytes": png(random_image(40, 40)), "path": None}],
        content,
    )
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)  # structs as HF datasets store them
    record = build_dataset(
        DataConfig(kind="parquet", path=str(path)), processor.tokenizer, processor=processor
    )[0]
    media = record.media
    assert media.sampling_rate_hz == processor.sampling_rate_hz == 16000
    assert [len(c) for c in media.audio] == [8000, 12000]  # 0.5 s and 0.75 s at 16 kHz
    assert len(media.images) == 1
    inputs = processor.model_inputs(media)
    processor.check_prompt_ids(record.prompt_ids, inputs)  # every audio and image pad filled
    markup = processor.markup
    assert pads(processor, record.prompt_ids, markup.audio_pad) > 0
    assert pads(processor, record.prompt_ids, markup.image_pad) > 0
    text = record.prompt
    assert text.index("Which is higher? ") < text.index(markup.audio_start) < text.index(" or ")
    assert text.count(markup.audio_start) == 2


def test_a_truncated_wav_row_is_skipped_and_counted_the_others_read(tmp_path, processor, caplog):
    wav = encoded_audio(tone(1.0), 16000, "WAV")
    (tmp_path / "good.wav").write_bytes(wav)
    (tmp_path / "cut.wav").write_bytes(wav[: len(wav) // 2])  # libsndfile alone reads it short
    content = [{"type": "audio"}, {"type": "text", "text": "High or low?"}]
    rows = [omni_row(name, [], content) for name in ("good.wav", "cut.wav", "good.wav")]
    for row in rows:
        del row["images"]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = build_dataset(
        DataConfig(kind="jsonl", path=str(path)), processor.tokenizer, processor=processor
    )
    with caplog.at_level(logging.WARNING, logger="relax_hpc.data.media_prompts"):
        records = [dataset[i] for i in range(3)]
    assert [r is None for r in records] == [False, True, False]
    assert list(dataset.skipped_rows) == [1]
    assert "truncated WAV" in dataset.skipped_rows[1] and "row 1 skipped" in caplog.text
    assert len(records[0].media.audio[0]) == 16000


def test_blank_media_replaces_each_clip_by_silence_of_its_length(tmp_path, processor):
    (tmp_path / "a.wav").write_bytes(encoded_audio(tone(0.5), 16000, "WAV"))
    row = omni_row("a.wav", [], [{"type": "audio"}, {"type": "text", "text": "?"}])
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row) + "\n")
    heard, deaf = (
        build_dataset(
            DataConfig(kind="jsonl", path=str(path), blank_media=blank),
            processor.tokenizer,
            processor=processor,
        )[0]
        for blank in (False, True)
    )
    assert heard.media.audio[0].shape == deaf.media.audio[0].shape == (8000,)
    assert not deaf.media.audio[0].any() and heard.media.audio[0].any()
    assert heard.prompt_ids == deaf.prompt_ids


def test_a_json_string_under_bytes_is_a_skipped_row_not_a_crash(tmp_path, processor):
    row = omni_row({"bytes": "RIFF....", "path": None}, [], [{"type": "audio"}])
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row) + "\n")
    dataset = build_dataset(
        DataConfig(kind="jsonl", path=str(path)), processor.tokenizer, processor=processor
    )
    assert dataset[0] is None and "not encoded bytes" in dataset.skipped_rows[0]


def test_omni_mc_rows_carry_an_image_and_a_clip_and_fit_the_reward(tmp_path, processor):
    from relax_hpc.data.schemas import SCHEMAS, write_rows
    from relax_hpc.rollout.rewards.registry import resolve_reward

    schema = SCHEMAS["omni_mc"]
    path = write_rows(schema.example_rows(3, 0), tmp_path / "omni.parquet", "parquet", schema)
    data = DataConfig(kind="parquet", path=str(path), schema="omni_mc")
    dataset = build_dataset(data, processor.tokenizer, processor=processor)
    for index in range(3):
        record = dataset[index]
        assert len(record.media.images) == 1 and len(record.media.audio) == 1
        processor.check_prompt_ids(record.prompt_ids, processor.model_inputs(record.media))
        assert record.answer == "AB"[index % 2] and record.metadata["options"]
        reward = resolve_reward("multiple_choice")
        right = reward(f"The answer is {record.answer}", record.answer, record.metadata)
        assert right.score == 1.0
