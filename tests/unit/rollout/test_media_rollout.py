"""The rollout with a vision model: the engine factory builds the media engine for it (one
construction path), the worker's loop over a tiny Qwen3-VL from config writes shards whose
groups carry their images once, and the SGLang engine sends the same images as processor
outputs with the media tokens masked (checked against a stand-in for ``sglang.Engine``)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.data.sampler import PromptSampler
from relax_hpc.models.multimodal import tiny_processor
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.rollout.assignment import GroupAssignment
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.rollout.engines.sglang_adapter import MEDIA_TOKEN_BIAS
from relax_hpc.rollout.loop import RolloutSettings, RolloutWorker
from relax_hpc.rollout.main import build_engine
from relax_hpc.spool import ShardWriter
from relax_hpc.spool.format import read_shard
from relax_hpc.spool.layout import SpoolLayout, list_names

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=3, seed=2)
PIXELS_64 = 64 * 64 * 3  # a shapes image, already at a size the processor keeps


@functools.cache
def vision_run():
    """grpo_tiny's run config with a tiny Qwen3-VL from config and the shapes task."""
    cfg = compose_run_config(["+experiment=grpo_tiny"])
    model = ModelConfig(
        name="tiny-vl",
        architecture="Qwen3VLForConditionalGeneration",
        modality="vision",
        tokenizer="char",
    )
    data = DataConfig(kind="media_task", media_task="shapes", eval_size=8)
    return dataclasses.replace(cfg, model=model, data=data)


@functools.cache
def vision_engine():
    return build_engine(vision_run(), torch.device("cpu"))


def test_the_engine_factory_builds_the_media_engine_for_a_vision_model():
    engine, tokenizer, processor = vision_engine()
    assert isinstance(engine, MediaTransformersEngine) and engine.processor is processor
    assert tokenizer is processor.tokenizer
    text_engine, _, text_processor = build_engine(
        compose_run_config(["+experiment=grpo_tiny"]), torch.device("cpu")
    )
    assert not isinstance(text_engine, MediaTransformersEngine) and text_processor is None


class Weights:
    """Stands in for the weight receiver (tested in tests/dist): the engine's weights are
    current; the worker stops after ``batches`` chunks."""

    def __init__(self, batches: int) -> None:
        self.calls, self.batches = 0, batches

    def wait_for(self, min_version: int, should_stop) -> bool:
        self.calls += 1
        return True


def test_the_worker_writes_groups_that_carry_their_images_once(tmp_path):
    engine, tokenizer, processor = vision_engine()
    dataset = build_dataset(vision_run().data, tokenizer, processor=processor)
    weights = Weights(batches=2)
    worker = RolloutWorker(
        settings=RolloutSettings(
            prompts_per_step=3,
            n_samples_per_prompt=4,
            max_staleness=1,
            eval_interval_steps=0,
            seed=1,
        ),
        engine=engine,
        sampler=PromptSampler(dataset, seed=1),
        score=lambda pairs: [(float(c.text.strip() == r.answer), {}) for c, r in pairs],
        writer=ShardWriter(tmp_path / "spool", "w0"),
        weights=weights,
        params=PARAMS,
        metrics=MetricsLogger(None, None),
        assignment=GroupAssignment(tmp_path / "assign", "r0", 3, 3, lease_s=60),
        should_stop=lambda: weights.calls > weights.batches,
    )
    assert worker.run() == 0
    ready = SpoolLayout(tmp_path / "spool").ready_dir
    shards = [ready / name for name in list_names(ready)]
    groups = [group for shard in shards for group in read_shard(shard)[1]]
    assert len(shards) == 2 and len(groups) == 6
    pad = tokenizer.convert_tokens_to_ids(processor.markup.image_pad)
    for group in groups:
        media = group[0].media
        assert len(group) == 4 and all(s.media is media for s in group)
        record = dataset[group[0].data_index]
        assert [i.shape for i in media.images] == [(64, 64, 3)]
        assert np.array_equal(media.images[0], record.media.images[0])
        for sample in group:  # the ids the trainer rebuilds the images' slots from
            assert list(sample.prompt_token_ids) == record.prompt_ids
            assert sum(int(t) == pad for t in sample.prompt_token_ids) == 4
            assert not set(sample.response_token_ids.tolist()) & set(processor.media_token_ids)
    # each group's pixels once in the shard, not once per sample
    import h5py

    with h5py.File(shards[-1], "r") as h5:
        assert h5["media/image/values"].size == 3 * PIXELS_64
    assert worker.shard_bytes == shards[-1].stat().st_size > 3 * PIXELS_64


def sglang_output(rid: str, token: int) -> dict:
    return {
        "text": "x",
        "output_ids": [token],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "length", "length": 1},
            "output_token_logprobs": [(-0.5, token, None)],
            "completion_tokens": 1,
        },
    }


def test_sglang_gets_the_same_images_as_processor_outputs_and_the_media_mask(sglang_stand_in):
    processor = tiny_processor("qwen3_vl")
    data = DataConfig(kind="media_task", media_task="shapes", eval_size=8)
    records = [build_dataset(data, processor.tokenizer, processor=processor)[i] for i in (1, 2)]
    group = media_request(records[0].media)  # one dict for the group's two samples
    requests = [
        GenerationRequest("0/0", records[0].prompt_ids, group),
        GenerationRequest("0/1", records[0].prompt_ids, group),
        GenerationRequest("1/0", records[1].prompt_ids, media_request(records[1].media)),
        GenerationRequest("text/0", processor.tokenizer("2+2=")["input_ids"]),
    ]
    outputs = [sglang_output(f"{r.sample_id}@1", 7) for r in requests]
    engine, sglang = sglang_stand_in(outputs, media_processor=processor)
    completions = engine.generate(requests, PARAMS)
    assert [c.prompt_ids for c in completions] == [r.prompt_ids for r in requests]
    ((_, kwargs),) = sglang.calls
    assert kwargs["input_ids"] == [r.prompt_ids for r in requests]  # pads already expanded
    first, same, other, text = kwargs["image_data"]
    assert text is None and len(first) == 1 and first[0] is same[0]  # one item, once per group
    item = first[0]
    assert item["format"] == "processor_output" and item.image_grid_thw is item["image_grid_thw"]
    expected = processor.model_inputs(records[0].media).tensors
    assert torch.equal(item["pixel_values"], expected["pixel_values"])
    assert item["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert not torch.equal(other[0]["pixel_values"], item["pixel_values"])
    bias = {str(t): MEDIA_TOKEN_BIAS for t in processor.media_token_ids}
    assert all(p["logit_bias"] == bias for p in kwargs["sampling_params"])
    assert "audio_data" not in kwargs


def test_sglang_refuses_prompt_ids_the_images_do_not_fill(sglang_stand_in):
    processor = tiny_processor("qwen3_vl")
    data = DataConfig(kind="media_task", media_task="shapes", eval_size=8)
    record = build_dataset(data, processor.tokenizer, processor=processor)[0]
    engine, _ = sglang_stand_in([], media_processor=processor)
    pad = processor.tokenizer.convert_tokens_to_ids(processor.markup.image_pad)
    first_pad = record.prompt_ids.index(pad)
    stale = record.prompt_ids[:first_pad] + record.prompt_ids[first_pad + 1 :]
    request = GenerationRequest("0/0", stale, media_request(record.media))
    with pytest.raises(ValueError, match="holds 3 image tokens, its images fill 4"):
        engine.generate([request], PARAMS)


def test_the_held_out_eval_reads_the_images_too(tmp_path):
    from relax_hpc.paths import RunPaths
    from relax_hpc.rollout.evaluation import make_evaluator

    engine, tokenizer, processor = vision_engine()
    cfg = dataclasses.replace(
        vision_run(), rollout=dataclasses.replace(vision_run().rollout, max_new_tokens=2)
    )
    seen = []

    def score(pairs):
        seen.extend(pairs)
        return [(0.0, {}) for _ in pairs]

    paths = RunPaths(tmp_path)
    paths.eval_history.parent.mkdir(parents=True, exist_ok=True)
    sent = []

    class Recording:  # the engine, recording what it is asked
        def generate(self, requests, params):
            sent.extend(requests)
            return engine.generate(requests, params)

    evaluate = make_evaluator(
        cfg, Recording(), tokenizer, score, MetricsLogger(None, None), paths, processor=processor
    )
    results = evaluate(0)
    assert results["data/eval_rows_skipped"] == 0.0 and len(seen) == len(sent) == 8
    for request, (_, record) in zip(sent, seen, strict=True):
        assert request.multimodal["image"][0] is record.media.images[0]


def test_sglang_gets_images_and_audio_as_processor_outputs_beside_expanded_ids(sglang_stand_in):
    processor = tiny_processor("qwen2_5_omni")
    data = DataConfig(kind="media_task", media_task="pitch", eval_size=8)
    record = build_dataset(data, processor.tokenizer, processor=processor)[3]
    assert record.media.audio and not record.media.images
    image = np.full((56, 56, 3), 200, np.uint8)
    both = processor.process("<image> and <audio>: high or low?", [image], list(record.media.audio))
    requests = [
        GenerationRequest("0/0", record.prompt_ids, media_request(record.media)),
        GenerationRequest("1/0", both.prompt_ids, media_request(both.payload)),
    ]
    engine, sglang = sglang_stand_in(
        [sglang_output(f"{r.sample_id}@1", 7) for r in requests], media_processor=processor
    )
    engine.generate(requests, PARAMS)
    ((_, kwargs),) = sglang.calls
    assert kwargs["image_data"][0] is None and len(kwargs["image_data"][1]) == 1
    (clip,), (clip_with_image,) = kwargs["audio_data"]
    assert clip["format"] == "processor_output"
    expected = processor.model_inputs(record.media).tensors
    assert torch.equal(clip["input_features"], expected["input_features"])
    assert torch.equal(clip.feature_attention_mask, expected["feature_attention_mask"])
    assert torch.equal(clip_with_image["input_features"], clip["input_features"])
    audio_pad = processor.tokenizer.convert_tokens_to_ids(processor.markup.audio_pad)
    first = record.prompt_ids.index(audio_pad)
    stale = record.prompt_ids[:first] + record.prompt_ids[first + 1 :]
    with pytest.raises(ValueError, match="audio tokens, its clips fill"):
        engine.generate([GenerationRequest("2/0", stale, media_request(record.media))], PARAMS)
