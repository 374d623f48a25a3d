"""The media engine against transformers itself: greedy generation equals
``model.generate`` on left-padded ragged batches with several images and clips per prompt,
and the trainer's one-forward log-probs equal the engine's."""

from __future__ import annotations

import copy

import pytest
import torch
from media_fixtures import left_padded, random_image, tiny, tone

from relax_hpc.media.inputs import MediaBatch, collate_media, media_budget_chunks
from relax_hpc.models.multimodal import load_media_model, save_media_model
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.trainer.media_logprobs import media_token_logprobs

PROMPTS = {
    "qwen3_vl": [
        ("<image> what? <image> and", [random_image(64, 64, 1), random_image(40, 90, 2)], []),
        ("a text-only prompt that is longer than the others", [], []),
        ("<image>x", [random_image(128, 128, 3)], []),
        (
            "count <image><image><image>",
            [random_image(32, 32, 4), random_image(64, 96, 5), random_image(50, 50, 6)],
            [],
        ),
    ],
    "qwen2_5_omni": [
        (
            "<image> what? <audio> <image> and",
            [random_image(56, 56, 1), random_image(40, 90, 2)],
            [tone(1.0)],
        ),
        ("hello <audio> there <audio>", [], [tone(0.5, 300.0), tone(1.7, 900.0)]),
        ("a text-only prompt that is longer than the others", [], []),
        ("<image><audio>", [random_image(112, 112, 3)], [tone(0.3, 2000.0)]),
    ],
}


@pytest.fixture(params=["qwen3_vl", "qwen2_5_omni"])
def setup(request):
    model, processor = tiny(request.param)
    processed = [processor.process(*prompt) for prompt in PROMPTS[request.param]]
    requests = [
        GenerationRequest(
            f"g{i}/0", p.prompt_ids, media_request(p.payload) if not p.payload.is_empty else None
        )
        for i, p in enumerate(processed)
    ]
    return model, processor, processed, requests


def hf_greedy(model, processor, processed, max_new_tokens):
    """``model.generate`` on the same left-padded batch, media tokens banned as ours are."""
    ids, mask = left_padded(processor, processed)
    length = ids.shape[1]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            **collate_media([p.inputs for p in processed]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            bad_words_ids=[[i] for i in processor.media_token_ids],
        )
    eos = processor.tokenizer.eos_token_id
    rows = out[:, length:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def test_greedy_generation_equals_transformers_generate(setup):
    model, processor, processed, requests = setup
    engine = MediaTransformersEngine(model, processor, max_batch_size=3)  # 2 batches
    completions = engine.generate(requests, SamplingParams(greedy=True, max_new_tokens=12))
    expected = hf_greedy(model, processor, processed, 12)
    assert [c.token_ids for c in completions] == expected
    assert sum(len(t) for t in expected) > 4 * 6  # not all trivially short


def test_prefill_uses_the_models_multimodal_positions(setup):
    model, processor, processed, _ = setup
    p = processed[0]
    ids = torch.tensor([p.prompt_ids])
    engine = MediaTransformersEngine(model, processor)
    request = GenerationRequest("x", p.prompt_ids, media_request(p.payload))
    from transformers import DynamicCache

    with torch.no_grad():
        logits, next_position = engine._prefill(
            [request], ids, torch.ones_like(ids), DynamicCache()
        )
        own = model(input_ids=ids, attention_mask=torch.ones_like(ids), **p.inputs.tensors).logits[
            :, -1
        ]
        consecutive = model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=torch.arange(ids.shape[1])[None],
            **p.inputs.tensors,
        ).logits[:, -1]
    masked = list(processor.media_token_ids)
    keep = [i for i in range(own.shape[-1]) if i not in masked]
    assert torch.allclose(logits[:, keep], own[:, keep], atol=1e-5)
    # consecutive positions are wrong by far more than float noise (~1e-6 here)
    assert (logits[:, keep] - consecutive[:, keep]).abs().max() > 1e-4
    # images compress positions: the next position is smaller than the prompt length
    assert int(next_position) < ids.shape[1]


def test_trainer_logprobs_equal_the_engines_and_train_the_towers(setup):
    model, processor, processed, requests = setup
    params = SamplingParams(temperature=1.3, max_new_tokens=10, seed=7)
    completions = MediaTransformersEngine(model, processor).generate(requests, params)
    rows = [c.prompt_ids + c.token_ids for c in completions]
    width = max(len(c.token_ids) for c in completions)
    ids = torch.full((len(rows), max(map(len, rows))), processor.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):  # right padding, as the trainer's batches
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    prompt_len = torch.tensor([len(c.prompt_ids) for c in completions])
    media = MediaBatch([None if p.payload.is_empty else p.inputs for p in processed])
    micro = media_budget_chunks(mask.sum(-1).tolist(), media.encoder_positions_B, 200)
    assert len(micro) > 1
    model.zero_grad(set_to_none=True)
    for chunk in micro:
        logprobs, entropy = media_token_logprobs(
            model,
            ids[chunk],
            mask[chunk],
            prompt_len[chunk],
            width,
            media.select(chunk).model_kwargs(),
            processor.media_token_ids,
            params.temperature,
            with_entropy=True,
        )
        for row, completion in zip(chunk, completions[chunk[0] : chunk[-1] + 1], strict=True):
            got = logprobs[chunk.index(row), : len(completion.token_ids)]
            assert torch.allclose(got, torch.tensor(completion.logprobs), atol=2e-5)
        assert torch.isfinite(entropy).all() and (entropy > 0).all()
        logprobs.sum().backward()
    towers = [p.grad for n, p in model.named_parameters() if "visual." in n]
    assert any(g is not None and g.abs().sum() > 0 for g in towers)
    model.zero_grad(set_to_none=True)


def test_samples_depend_on_seed_and_sample_id_not_on_the_batch(setup):
    model, processor, _, requests = setup
    engine = MediaTransformersEngine(model, processor)
    params = SamplingParams(temperature=1.5, max_new_tokens=8, seed=5)
    together = engine.generate(requests, params)
    alone = [engine.generate([r], params)[0] for r in reversed(requests)][::-1]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_groups_rows_share_one_prefill_and_generate_as_if_alone(setup):
    """GRPO's shape: each prompt asked 3 times with one media object; the towers and the
    prefill see each prompt once, and every row samples what it would alone."""
    model, processor, _, requests = setup
    engine = MediaTransformersEngine(model, processor)
    grouped = [
        GenerationRequest(f"{r.sample_id}/{k}", r.prompt_ids, r.multimodal)
        for r in requests
        for k in range(3)
    ]
    prefill_rows = []
    hook = engine.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: prefill_rows.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    params = SamplingParams(temperature=1.5, max_new_tokens=6, seed=7)
    try:
        shared = engine.generate(grouped, params)
    finally:
        hook.remove()
    assert prefill_rows[0] == len(requests)  # one row per prompt and media, not 3
    alone = [engine.generate([r], params)[0] for r in grouped]
    for a, b in zip(shared, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_media_tokens_are_never_written_even_by_a_model_that_prefers_them():
    model, processor = tiny("qwen3_vl")
    model = copy.deepcopy(model)
    pad = processor.tokenizer.convert_tokens_to_ids(processor.markup.image_pad)
    with torch.no_grad():  # a huge image-pad logit (positive for this seed's hidden states)
        model.lm_head.weight[pad] = 50.0
    p = processor.process("<image>", [random_image(64, 64)])
    ids = torch.tensor([p.prompt_ids])
    with torch.no_grad():
        plain = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            **p.inputs.tensors,
            do_sample=False,
            max_new_tokens=3,
        )
    assert plain[0, ids.shape[1] :].tolist().count(pad) > 0  # unmasked, it writes pads
    request = GenerationRequest("g/0", p.prompt_ids, media_request(p.payload))
    for params in (
        SamplingParams(greedy=True, max_new_tokens=6),
        SamplingParams(temperature=1.0, max_new_tokens=6),
    ):
        (completion,) = MediaTransformersEngine(model, processor).generate([request], params)
        assert not set(completion.token_ids) & set(processor.media_token_ids)


def test_a_media_model_memory_mapped_from_its_folder_is_released_and_resumed(tmp_path):
    """``mode=sync`` with a user's folder: its weights are mapped from the file (not resizable)."""
    model, processor = load_media_model(save_media_model(tmp_path, *tiny("qwen3_vl")))
    assert not model.lm_head.weight.untyped_storage().resizable()
    processed = [processor.process(*prompt) for prompt in PROMPTS["qwen3_vl"][:3]]
    requests = [
        GenerationRequest(
            f"g{i}/0", p.prompt_ids, None if p.payload.is_empty else media_request(p.payload)
        )
        for i, p in enumerate(processed)
    ]
    engine = MediaTransformersEngine(model, processor)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5)
    before = [c.token_ids for c in engine.generate(requests, params)]
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    for _ in range(2):  # the second time, a resumed engine that got weights while released
        engine.release_memory()
        assert all(not t.untyped_storage().nbytes() for t in model.parameters())
        engine.load_weights(weights)
        assert [c.token_ids for c in engine.generate(requests, params)] == before
