"""Image datasets read through the media path: published layouts (Geometry3K Parquet with PNG
bytes, JSONL with paths relative to the file, typed chat parts), the blank control, the
built-in shapes task, and a corrupt image skipped and counted instead of a crash."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from relax_hpc.config import ConfigError, validate_run_config
from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.data.sampler import PromptSampler
from relax_hpc.models.multimodal import tiny_processor

GEO3K_TYPES = pa.schema(
    [
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("problem", pa.string()),
        ("answer", pa.string()),
    ]
)


@pytest.fixture(scope="module")
def processor():
    return tiny_processor("qwen3_vl")


def png(height: int, width: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_pads(processor, prompt_ids) -> int:
    pad = processor.tokenizer.convert_tokens_to_ids(processor.markup.image_pad)
    return sum(token == pad for token in prompt_ids)


def write_geo3k(path, images_per_row):
    rows = [
        {
            "images": [{"bytes": image, "path": None} for image in images],
            "problem": "<image>Find x.",
            "answer": str(12 + i),
        }
        for i, images in enumerate(images_per_row)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=GEO3K_TYPES), path)
    return path


def geo3k_config(path, *overrides):
    overrides = ["+experiment=grpo_tiny", "data=geo3k", f"data.path={path}", *overrides]
    return compose_run_config(list(overrides)).data


def test_geo3k_parquet_rows_become_prompts_with_their_fitted_images(tmp_path, processor):
    path = write_geo3k(tmp_path / "train.parquet", [[png(24, 32, 1)], [png(200, 150, 2)]])
    dataset = build_dataset(geo3k_config(path), processor.tokenizer, processor=processor)
    first, second = dataset[0], dataset[1]
    assert (first.answer, second.answer) == ("12", "13")
    assert first.metadata == {} and first.images == ()
    assert first.source_prompt == "<image>Find x."
    # fitted to the processor's pixel range: 32x32 .. 128x128 in 32-pixel steps
    assert [i.shape for i in first.media.images] == [(32, 32, 3)]
    assert [i.shape for i in second.media.images] == [(128, 96, 3)]
    inputs = processor.model_inputs(second.media)
    processor.check_prompt_ids(second.prompt_ids, inputs)  # every pad filled by the image
    assert image_pads(processor, second.prompt_ids) == inputs.num_media_tokens == 12
    assert "<|vision_start|><|image_pad|>" in second.prompt and second.prompt.endswith(
        "Find x.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_jsonl_paths_relative_to_the_file_and_typed_content_parts(tmp_path, processor, monkeypatch):
    folder = tmp_path / "data"
    (folder / "images").mkdir(parents=True)
    (folder / "images" / "a.png").write_bytes(png(64, 64, 3))
    (folder / "images" / "b.png").write_bytes(png(32, 96, 4))
    content = [
        {"type": "text", "text": "How many? "},
        {"type": "image"},
        {"type": "text", "text": " and "},
        {"type": "image"},
    ]
    row = {
        "prompt": [{"role": "user", "content": content}],
        "answer": "2",
        "images": ["images/a.png", {"bytes": None, "path": "images/b.png"}],
        "source": "by hand",
    }
    path = folder / "train.jsonl"
    path.write_text(json.dumps(row) + "\n")
    monkeypatch.chdir(tmp_path)  # relative to the data file, not to the working directory
    cfg = DataConfig(kind="jsonl", path=str(path.relative_to(tmp_path)))
    record = build_dataset(cfg, processor.tokenizer, processor=processor)[0]
    assert [i.shape for i in record.media.images] == [(64, 64, 3), (32, 96, 3)]
    assert record.metadata == {"source": "by hand"}
    text = record.prompt
    assert text.index("How many? <|vision_start|>") < text.index(" and <|vision_start|>")
    assert image_pads(processor, record.prompt_ids) == 4 + 3


def test_a_corrupt_image_row_is_skipped_counted_and_logged(tmp_path, processor, caplog):
    good, corrupt = png(32, 32, 5), png(32, 32, 6)[:40]  # a truncated PNG
    path = write_geo3k(tmp_path / "train.parquet", [[good], [corrupt], [good], [b"not an image"]])
    dataset = build_dataset(geo3k_config(path), processor.tokenizer, processor=processor)
    with caplog.at_level(logging.WARNING, logger="relax_hpc.data.media_prompts"):
        records = [dataset[i] for i in range(len(dataset))]
        assert dataset[1] is None  # remembered: not decoded (nor logged) again
    assert [r is None for r in records] == [False, True, False, True]
    assert sorted(dataset.skipped_rows) == [1, 3]
    assert "not a readable image" in dataset.skipped_rows[1]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and "train split" in logged[0] and "row 1 skipped" in logged[0]
    assert str(path) in logged[0]
    # The prompt stream goes on without them, epoch after epoch.
    sampler = PromptSampler(dataset, seed=0)
    drawn = [index for index, _ in sampler.take(6)]
    assert set(drawn) == {0, 2} and sampler.skipped_indices == {1, 3}


def test_limits_skip_oversized_images_and_are_validated_at_submit(tmp_path, processor):
    path = write_geo3k(tmp_path / "train.parquet", [[png(24, 32)], [png(100, 100)]])
    data = geo3k_config(path, "data.max_image_pixels=5000")
    dataset = build_dataset(data, processor.tokenizer, processor=processor)
    assert dataset[0] is not None and dataset[1] is None
    assert "exceed the limit of 5000" in dataset.skipped_rows[1]
    for override, field in [
        ("data.max_image_pixels=0", "data.max_image_pixels"),
        ("data.max_media_bytes=-1", "data.max_media_bytes"),
        ("data.blank_media=true", "data.blank_media"),  # a text model has nothing to blank
        ("data.kind=media_task", "data.kind"),
    ]:
        cfg = compose_run_config(["+experiment=grpo_tiny", override])
        with pytest.raises(ConfigError) as error:
            validate_run_config(cfg)
        assert error.value.field == field


def test_blank_media_keeps_sizes_prompts_and_answers(tmp_path, processor):
    path = write_geo3k(tmp_path / "train.parquet", [[png(24, 32, 7)], [png(64, 128, 8)]])
    seen = build_dataset(geo3k_config(path), processor.tokenizer, processor=processor)
    blank = build_dataset(
        geo3k_config(path, "data.blank_media=true"), processor.tokenizer, processor=processor
    )
    for index in range(2):
        image, grey = seen[index].media.images[0], blank[index].media.images[0]
        assert grey.shape == image.shape and (grey == 128).all() and (image != 128).any()
        assert blank[index].prompt_ids == seen[index].prompt_ids
        assert blank[index].answer == seen[index].answer


def test_the_shapes_task_as_a_dataset_and_its_blank_control(processor):
    data = DataConfig(kind="media_task", media_task="shapes", eval_size=8)
    train = build_dataset(data, processor.tokenizer, processor=processor)
    held_out = build_dataset(data, processor.tokenizer, split="eval", processor=processor)
    assert len(held_out) == 8 and [held_out[i].answer for i in range(4)] == ["1", "2", "3", "4"]
    record = train[5]
    assert record.answer == "2" and record.media.images[0].shape == (64, 64, 3)
    assert record.metadata["task"] == "shapes" and "images" not in record.metadata
    blank = DataConfig(kind="media_task", media_task="shapes", eval_size=8, blank_media=True)
    control = build_dataset(blank, processor.tokenizer, processor=processor)[5]
    assert (control.media.images[0] == 128).all() and control.prompt_ids == record.prompt_ids
