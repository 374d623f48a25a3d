"""The media warm start: keyed by everything that shapes the weights, cached, loadable."""

from __future__ import annotations

import json

import pytest
import torch
from media_fixtures import tiny

from relax_hpc.data.media_tasks import MediaTask
from relax_hpc.models.multimodal import build_tiny_media_model, load_media_model
from relax_hpc.tasks.media import MediaWarmStartConfig, media_warm_start, supervised_media_batch
from relax_hpc.tasks.warm_start import LOCKS_DIR

RECIPE = MediaWarmStartConfig(steps=2, batch_size=4, warmup_steps=1)


def test_warm_start_is_cached_keyed_and_loads_as_its_model_class(tmp_path):
    folder = media_warm_start("qwen3_vl", "shapes", tmp_path, RECIPE)
    metadata = json.loads((folder / "warmstart.json").read_text())
    assert metadata["inputs"]["recipe"]["steps"] == 2 and metadata["inputs"]["task"] == "shapes"
    names = [p.name for p in tmp_path.iterdir() if p.name != LOCKS_DIR]
    assert names == [folder.name]  # no temp folder left
    mtime = (folder / "model.safetensors").stat().st_mtime_ns
    assert media_warm_start("qwen3_vl", "shapes", tmp_path, RECIPE) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime  # not trained again
    other = media_warm_start(
        "qwen3_vl",
        "shapes",
        tmp_path,
        MediaWarmStartConfig(steps=2, batch_size=4, warmup_steps=1, correct_prob=0.5),
    )
    assert other != folder
    model, processor = load_media_model(folder)
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    fresh, _ = build_tiny_media_model("qwen3_vl", seed=RECIPE.seed)
    assert not all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    assert processor.fingerprint == build_tiny_media_model("qwen3_vl")[1].fingerprint


def test_supervised_batch_puts_the_loss_on_answer_and_eos_only():
    _, processor = tiny("qwen3_vl")
    task = MediaTask("shapes", eval_size=4)
    examples = [task.example("eval", i) for i in range(2)]
    batch = supervised_media_batch(processor, examples, ["3", "1"])
    labels = batch["labels"]
    eos = processor.tokenizer.eos_token_id
    three, one = processor.tokenizer.convert_tokens_to_ids(["3", "1"])
    assert [row[row != -100].tolist() for row in labels] == [[three, eos], [one, eos]]
    assert batch["pixel_values"].shape[0] == 2 * 16 and batch["image_grid_thw"].shape == (2, 3)


def test_a_task_the_family_cannot_perceive_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a model family"):
        media_warm_start("qwen3_vl", "pitch", tmp_path, RECIPE)
