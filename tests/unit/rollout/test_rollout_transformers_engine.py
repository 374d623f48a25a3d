"""The transformers engine: per-sample reproducibility, log-prob convention, stopping."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_qwen3, tiny_qwen3_config

from relax_hpc.models.build import build_causal_lm
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.transformers_engine import (
    TransformersEngine,
    distinct_rows,
    top_k_top_p_filter,
)

PROMPTS = ["1+2=", "37+48=", "hello there, ", "0=", "The quick brown fox"]


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    model, tokenizer = tiny_qwen3()
    return TransformersEngine(model, tokenizer, max_batch_size=3)


def requests(engine, prompts=PROMPTS) -> list[GenerationRequest]:
    return [
        GenerationRequest(f"g{i}/0", engine.tokenizer(p)["input_ids"])
        for i, p in enumerate(prompts)
    ]


def recomputed_logprobs(engine, completion, temperature) -> torch.Tensor:
    ids = torch.tensor([completion.prompt_ids + completion.token_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(completion.prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)


def test_samples_depend_on_seed_and_sample_id_not_on_the_batch(engine):
    params = SamplingParams(temperature=1.3, max_new_tokens=10, seed=5)
    batch = engine.generate(requests(engine), params)  # 2 micro-batches of at most 3
    reversed_batch = engine.generate(requests(engine)[::-1], params)[::-1]
    alone = [engine.generate([r], params)[0] for r in requests(engine)]
    for a, b, c in zip(batch, reversed_batch, alone, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(c.logprobs, abs=1e-5)
    other_seed = engine.generate(requests(engine), dataclasses.replace(params, seed=6))
    assert [c.token_ids for c in other_seed] != [c.token_ids for c in batch]
    renamed = [GenerationRequest(r.sample_id + "x", r.prompt_ids) for r in requests(engine)]
    assert [c.token_ids for c in engine.generate(renamed, params)] != [c.token_ids for c in batch]


def group_requests(engine, prompts, samples_per_prompt) -> list[GenerationRequest]:
    """GRPO's shape: each prompt asked ``samples_per_prompt`` times, as consecutive rows."""
    return [
        GenerationRequest(f"g{i}/{k}", engine.tokenizer(p)["input_ids"])
        for i, p in enumerate(prompts)
        for k in range(samples_per_prompt)
    ]


def test_distinct_rows_maps_each_row_to_its_keys_first_row():
    firsts, index = distinct_rows([(1, 2), (3,), (1, 2), (0, 3), (3,)])
    assert firsts == [0, 1, 3]
    assert index == [0, 1, 0, 2, 1]  # [3] and [0, 3] differ: padding never merges them


def test_a_shared_prompt_runs_once_and_each_row_generates_as_if_alone():
    model, tokenizer = tiny_qwen3()
    engine = TransformersEngine(model, tokenizer)  # one micro-batch of all 12 rows
    batch_sizes = []
    hook = engine.model.register_forward_pre_hook(
        lambda _module, _args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    grouped = group_requests(engine, ["1+2=", "37+48=", "0="], samples_per_prompt=4)
    try:
        shared = engine.generate(grouped, params)
    finally:
        hook.remove()
    assert batch_sizes[0] == 3  # the prefill: one row per distinct prompt, not 12
    alone = [engine.generate([r], params)[0] for r in grouped]
    for a, b in zip(shared, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert len({tuple(c.token_ids) for c in shared}) > 3  # the rows of a prompt diverge


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_full_forward_pass(engine, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=12, top_p=0.9, seed=1)
    for completion in engine.generate(requests(engine), params):
        assert len(completion.logprobs) == len(completion.token_ids) > 0
        expected = recomputed_logprobs(engine, completion, temperature)
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-5)


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate(requests(engine), SamplingParams(greedy=True, max_new_tokens=8))
    top1 = engine.generate(requests(engine), SamplingParams(top_k=1, max_new_tokens=8, seed=3))
    assert [c.token_ids for c in greedy] == [c.token_ids for c in top1]
    for completion in greedy:  # greedy reports temperature-1 log-probs
        assert torch.allclose(
            torch.tensor(completion.logprobs),
            recomputed_logprobs(engine, completion, 1.0),
            atol=1e-5,
        )


def test_stop_strings_end_a_completion_with_the_completing_token(engine):
    free = engine.generate(requests(engine), SamplingParams(max_new_tokens=16, seed=2))
    # The third character each completion produced is a stop string that must end it there.
    for request, completion in zip(requests(engine), free, strict=True):
        text = completion.text
        stop = text[2] if len(text) > 2 else None
        if stop is None:
            continue
        params = SamplingParams(max_new_tokens=16, seed=2, stop=(stop, "never-produced"))
        stopped = engine.generate([request], params)[0]
        assert stopped.finish_reason == "stop" and stopped.stop == stop
        assert stopped.text == text[: text.index(stop) + 1]
        assert stopped.token_ids == completion.token_ids[: len(stopped.token_ids)]


def test_length_finish_and_eos(engine):
    out = engine.generate(requests(engine), SamplingParams(max_new_tokens=3, seed=0))
    assert all(len(c.token_ids) <= 3 for c in out)
    assert all(
        c.finish_reason == "length" for c in out if len(c.token_ids) == 3 and c.token_ids[-1] != 2
    )
    eos_engine = TransformersEngine(engine.model, engine.tokenizer)
    eos_engine.stop_token_ids = frozenset(range(len(engine.tokenizer)))  # every token ends it
    assert all(
        c.finish_reason == "stop" and len(c.token_ids) == 1
        for c in eos_engine.generate(requests(engine), SamplingParams(seed=0))
    )


def test_load_state_dict_changes_generations_and_version(engine):
    tokenizer = engine.tokenizer
    cfg = tiny_qwen3_config()
    fresh = TransformersEngine(build_causal_lm(cfg, tokenizer, seed=0), tokenizer)
    params = SamplingParams(max_new_tokens=6, seed=0)
    before = fresh.generate(requests(engine), params)
    other = build_causal_lm(cfg, tokenizer, seed=1).state_dict()
    fresh.load_state_dict(other.items(), policy_version=7)
    after = fresh.generate(requests(engine), params)
    assert fresh.policy_version == 7 and all(c.policy_version == 7 for c in after)
    reference = TransformersEngine(build_causal_lm(cfg, tokenizer, seed=1), tokenizer).generate(
        requests(engine), params
    )
    assert [c.logprobs for c in after] == [c.logprobs for c in reference]
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    with pytest.raises(ValueError, match="not a parameter"):
        fresh.load_state_dict({"nope": torch.zeros(1)}, policy_version=8)
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({"lm_head.weight": torch.zeros(2, 2)}, policy_version=8)


def test_top_k_top_p_filter():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(top_k_top_p_filter(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(top_k_top_p_filter(logits, -1, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(top_k_top_p_filter(logits, -1, 0.81)).tolist() == [
        [False, False, False, True]
    ]
    assert torch.isinf(top_k_top_p_filter(logits, -1, 0.1)).tolist() == [[False, True, True, True]]


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="greedy"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


@pytest.mark.parametrize("max_new_tokens", [1, 7, 16, 300])
def test_uniforms_drawn_up_front_are_the_per_token_draws(max_new_tokens):
    """The engine draws each sample's uniforms in one call; token t must still get the t-th
    draw of the sample's own generator, as one draw per token gave (resumed and redone
    samples regenerate the same completions)."""
    from relax_hpc.rollout.engines.base import sample_seed
    from relax_hpc.rollout.engines.transformers_engine import _uniforms

    params = SamplingParams(max_new_tokens=max_new_tokens, seed=11)
    reqs = [GenerationRequest(f"{g}/{j}", [1]) for g in (0, 5) for j in range(3)]
    for request, row in zip(reqs, _uniforms(reqs, params), strict=True):
        generator = torch.Generator().manual_seed(sample_seed(11, request.sample_id))
        one_by_one = [torch.rand((), generator=generator, dtype=torch.float64) for _ in row]
        assert torch.equal(row, torch.stack(one_by_one)), request.sample_id


def transformers_mask(model, mask_BK: torch.Tensor, query_len: int):
    """The 4D mask transformers builds for ``model`` from a padding mask: what the engine's
    own must equal (``None``: transformers would build none)."""
    from transformers import DynamicCache
    from transformers.masking_utils import create_causal_mask

    cache = DynamicCache()
    past = mask_BK.shape[1] - query_len
    if past:  # a cache holding ``past`` positions
        shape = (mask_BK.shape[0], model.config.num_key_value_heads, past, model.config.head_dim)
        for layer in range(model.config.num_hidden_layers):
            cache.update(torch.zeros(shape), torch.zeros(shape), layer)
    return create_causal_mask(
        config=model.config,
        input_embeds=torch.zeros(mask_BK.shape[0], query_len, model.config.hidden_size),
        attention_mask=mask_BK,
        cache_position=torch.arange(past, past + query_len),
        past_key_values=cache,
        position_ids=None,
    )


@pytest.mark.parametrize("query_len", [6, 1])  # a prefill, a decode step
def test_the_engine_builds_the_mask_transformers_would(engine, query_len):
    from relax_hpc.rollout.engines.transformers_engine import padded_causal_mask

    assert engine.builds_own_masks
    mask_BK = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]])
    if query_len == 1:
        mask_BK = torch.cat([mask_BK, torch.ones(3, 1, dtype=torch.long)], dim=1)
    ours = padded_causal_mask(mask_BK, query_len)
    theirs = transformers_mask(engine.model, mask_BK, query_len)
    assert ours.dtype == theirs.dtype == torch.bool and torch.equal(ours, theirs)


def test_own_masks_generate_exactly_what_transformers_masks_do():
    model, tokenizer = tiny_qwen3()
    own, theirs = TransformersEngine(model, tokenizer), TransformersEngine(model, tokenizer)
    theirs.builds_own_masks = False
    params = SamplingParams(temperature=1.0, max_new_tokens=8, seed=2)
    a, b = own.generate(requests(own), params), theirs.generate(requests(theirs), params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 4},
        {"layer_types": ["full_attention", "sliding_attention"]},
        {"_attn_implementation": "eager"},
        {"model_type": "gemma3_text"},
    ],
)
def test_a_model_whose_mask_is_not_plain_causal_sdpa_keeps_transformers_masks(change):
    import copy

    from relax_hpc.rollout.engines.transformers_engine import has_plain_causal_sdpa_masks

    model, _ = tiny_qwen3()
    assert has_plain_causal_sdpa_masks(model.config)
    config = copy.deepcopy(model.config)
    for name, value in change.items():
        setattr(config, name, value)
    assert not has_plain_causal_sdpa_masks(config)
