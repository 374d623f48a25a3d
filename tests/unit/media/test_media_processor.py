"""One processor for rollout and trainer: prompt forms, placeholder expansion, the payload
the spool stores and the bit-identical rebuild of the model inputs from it."""

from __future__ import annotations

import h5py
import pytest
import torch
from media_fixtures import random_image, tiny, tone

from relax_hpc.data.media_tasks import MediaTask
from relax_hpc.media.decode import decode_audio, decode_images
from relax_hpc.media.errors import MediaError
from relax_hpc.media.inputs import MediaBatch, collate_media, media_budget_chunks
from relax_hpc.media.markup import FAMILIES
from relax_hpc.media.payload import MediaPayload


def counts(processor, ids):
    vocab = processor.tokenizer.get_vocab()
    markup = processor.markup
    return ids.count(vocab[markup.image_pad]), (
        ids.count(vocab[markup.audio_pad]) if markup.audio_pad else 0
    )


def test_typed_parts_and_text_marks_give_the_same_tokens():
    _, processor = tiny("qwen2_5_omni")
    images, audio = [random_image(64, 64), random_image(30, 100, seed=3)], [tone(1.0)]
    typed = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look "},
                {"type": "image"},
                {"type": "audio"},
                {"type": "text", "text": " and "},
                {"type": "image"},
                {"type": "text", "text": "?"},
            ],
        }
    ]
    marked = processor.process("look <image><audio> and <image>?", images, audio)
    assert processor.process(typed, images, audio).prompt_ids == marked.prompt_ids
    grid = marked.inputs.tensors["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4], [1, 2, 8]]  # 64x64 and 28x112 after fitting (patch 14)
    assert counts(processor, marked.prompt_ids) == (4 + 4, 25)  # grid // merge**2; 1 s -> 25
    assert marked.inputs.num_media_tokens == 33
    assert marked.text.startswith("<|im_start|>user\nlook <|vision_start|><|image_pad|>")
    assert marked.text.endswith("?<|im_end|>\n<|im_start|>assistant\n")


def test_a_prompt_without_marks_gets_its_media_first_and_no_template_works_too():
    _, processor = tiny("qwen3_vl")
    image = random_image(64, 64)
    front = processor.process("what?", [image])
    assert front.prompt_ids == processor.process("<image>what?", [image]).prompt_ids
    plain = processor.process("<image>what?", [image], apply_chat_template=False)
    assert plain.text == "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>what?"
    system = processor.process("<image>what?", [image], system_prompt="Be brief.")
    assert system.text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_audio_token_counts_follow_the_models_own_encoder_lengths(family):
    import transformers.models.qwen2_5_omni.modeling_qwen2_5_omni as omni25
    import transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe as omni3

    frames = torch.arange(1, 3001)
    if family == "qwen2_5_omni":
        expected = omni25.Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, frames)[1]
    else:
        expected = omni3._get_feat_extract_output_lengths(frames)
    markup = FAMILIES[family]
    assert [markup.num_audio_tokens(n) for n in frames.tolist()] == expected.tolist()


def test_fitted_images_give_exactly_what_the_image_processor_gives_the_original():
    _, processor = tiny("qwen3_vl")
    originals = [random_image(70, 50), random_image(300, 200, seed=1), random_image(20, 20)]
    payload = processor.fit(originals, [])
    assert [i.shape for i in payload.images] == [(64, 64, 3), (128, 96, 3), (32, 32, 3)]
    direct = processor.image_processor(images=originals, return_tensors="pt")
    rebuilt = processor.model_inputs(payload).tensors
    assert torch.equal(rebuilt["pixel_values"], direct["pixel_values"].float())
    assert torch.equal(rebuilt["image_grid_thw"], direct["image_grid_thw"])


def test_row_to_inputs_to_stored_payload_to_identical_inputs(tmp_path):
    _, processor = tiny("qwen2_5_omni")
    task = MediaTask("pitch", eval_size=8)
    row = task.row("eval", 3)
    row["images"] = [{"bytes": MediaTask("shapes").row("eval", 1)["images"][0]["bytes"]}]
    row["prompt"][0]["content"].insert(0, {"type": "image"})
    images = decode_images(row["images"], row=3, key="images")
    audio = decode_audio(row["audio"], sampling_rate_hz=processor.sampling_rate_hz)
    processed = processor.process(row["prompt"], images, audio)
    arrays, meta = processed.payload.to_arrays()
    with h5py.File(tmp_path / "group.h5", "w") as h5:  # what a spool shard would hold
        for name, array in arrays.items():
            h5[name] = array
        h5.attrs.update(meta)
    with h5py.File(tmp_path / "group.h5", "r") as h5:
        stored = MediaPayload.from_arrays({k: h5[k][()] for k in arrays}, dict(h5.attrs))
    rebuilt = processor.model_inputs(stored)
    assert rebuilt.equals(processed.inputs)
    assert rebuilt.num_media_tokens == processed.inputs.num_media_tokens
    processor.check_prompt_ids(processed.prompt_ids, rebuilt)
    tensors = processed.inputs.tensors
    assert stored.images[0].nbytes * 8 == tensors["pixel_values"].numel() * 4  # 2 frames, f32
    assert stored.audio[0].nbytes < tensors["input_features"].numel() * 4


def test_empty_payload_round_trips():
    _, processor = tiny("qwen3_vl")
    payload = processor.fit([], [])
    arrays, meta = payload.to_arrays()
    assert MediaPayload.from_arrays(arrays, meta) == payload
    assert processor.model_inputs(payload).tensors == {}


def test_mismatches_are_media_errors_naming_the_fix():
    vl = tiny("qwen3_vl")
    _, processor = tiny("qwen2_5_omni")
    with pytest.raises(MediaError, match="1 image and 0 audio slots for 2 images"):
        processor.process("<image>", [random_image(8, 8), random_image(8, 8)])
    with pytest.raises(MediaError, match="exceed the feature extractor's 2 s chunk"):
        processor.process("<audio>", [], [tone(2.5)])
    with pytest.raises(MediaError, match="too short for one audio token"):
        processor.process("<audio>", [], [tone(0.01)])
    with pytest.raises(MediaError, match="content part type 'video'"):
        processor.process([{"role": "user", "content": [{"type": "video"}]}])
    payload = processor.fit([random_image(8, 8)], [])
    with pytest.raises(MediaError, match="same model folder"):
        vl[1].model_inputs(payload)
    with pytest.raises(MediaError, match="holds 4 media tokens, its media fill 8"):
        processor.check_prompt_ids(
            processor.process("<image>", [random_image(56, 56)]).prompt_ids,
            processor.process("<image>", [random_image(56, 112)]).inputs,
        )
    _, vl_processor = vl
    with pytest.raises(MediaError, match="qwen3_vl takes no audio"):
        vl_processor.process("<audio>", [], [tone(1.0)])


def test_a_template_that_drops_media_parts_is_refused():
    _, processor = tiny("qwen3_vl")
    template = processor.tokenizer.chat_template
    processor.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    try:
        with pytest.raises(MediaError, match="model's own template"):
            processor.process("<image>", [random_image(32, 32)])
    finally:
        processor.tokenizer.chat_template = template


def test_ragged_batches_concatenate_media_in_row_order():
    _, processor = tiny("qwen2_5_omni")
    rows = [
        processor.process(
            "<image><image><audio>", [random_image(56, 56), random_image(28, 56)], [tone(1.0)]
        ).inputs,
        None,  # a text-only row
        processor.process("<audio><audio>", [], [tone(0.5), tone(1.5)]).inputs,
        processor.process("<image>", [random_image(112, 56)]).inputs,
    ]
    merged = collate_media(rows)
    assert merged["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4], [1, 8, 4]]
    assert merged["pixel_values"].shape[0] == 16 + 8 + 32
    assert merged["feature_attention_mask"].sum(-1).tolist() == [100, 50, 150]
    picked = MediaBatch(rows).select([3, 1, 0]).model_kwargs()
    assert picked["image_grid_thw"].tolist() == [[1, 8, 4], [1, 4, 4], [1, 2, 4]]
    assert MediaBatch(rows).encoder_positions_B == [24 + 100, 0, 200, 32]


def test_micro_batches_count_the_towers_work():
    assert media_budget_chunks([10, 10, 10, 10], [0, 0, 0, 0], 40) == [[0, 1, 2, 3]]
    assert media_budget_chunks([10, 10, 10, 10], [0, 30, 0, 0], 40) == [[0], [1], [2, 3]]
    assert media_budget_chunks([50, 10], [0, 0], 40) == [[0], [1]]  # too long alone: still runs
