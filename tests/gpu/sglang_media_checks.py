"""What the SGLang media tests (images: test_sglang_media.py, audio: test_sglang_omni.py)
share: a tiny random media model served from a folder, a task's prompts built through the
rollout's own path (dataset -> ``media_request`` -> ``sglang_media``), and the two checks,
the same for every media kind."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.models.multimodal import build_tiny_media_model, save_media_model
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.rollout.engines.sglang_engine import SGLangEngine

# head_dim 64 (the smallest every SGLang attention backend supports); mrope over 32 pairs
ARCH = {
    "text_config": {
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_scaling": {"rope_type": "default", "mrope_section": [16, 8, 8]},
    }
}


@contextlib.contextmanager
def served_tiny_media_model(folder: Path, family: str) -> Iterator[tuple]:
    """(engine, model, processor): a random tiny ``family`` model (seed 0) saved to
    ``folder`` and served by ``SGLangEngine``; shut down on exit."""
    model, processor = build_tiny_media_model(family, ARCH, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # sharper logits: lost media show above bf16 noise
    save_media_model(folder, model, processor)
    engine = SGLangEngine(
        folder,
        mem_fraction=0.2,
        dtype="bfloat16",
        media_processor=processor,
        extra_server_args={"disable_cuda_graph": True},
    )
    try:
        yield engine, model, processor
    finally:
        engine.shutdown()


def task_requests(processor, task: str, count: int = 4) -> list[GenerationRequest]:
    """The first ``count`` held-out prompts of the media task ``task``, as the rollout
    sends them."""
    data = DataConfig(kind="media_task", media_task=task, eval_size=8)
    dataset = build_dataset(data, processor.tokenizer, split="eval", processor=processor)
    records = [dataset[i] for i in range(count)]
    return [
        GenerationRequest(f"{i}/0", r.prompt_ids, media_request(r.media))
        for i, r in enumerate(records)
    ]


def assert_generates_as_transformers(served: tuple, task: str, max_new_tokens: int) -> None:
    """Greedy tokens and log-probs equal the transformers ``MediaTransformersEngine``'s on
    the same weights (to bf16 tolerance), and no media token is ever sampled."""
    engine, model, processor = served
    requests = task_requests(processor, task)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    served_out = engine.generate(requests, greedy)
    reference = MediaTransformersEngine(model.to("cuda", torch.bfloat16), processor)
    local_out = reference.generate(requests, greedy)
    for ours, theirs in zip(served_out, local_out, strict=True):
        assert not set(ours.token_ids) & set(processor.media_token_ids)
        assert ours.token_ids[:2] == theirs.token_ids[:2]  # bf16 may part later
        torch.testing.assert_close(
            torch.tensor(ours.logprobs[:2]), torch.tensor(theirs.logprobs[:2]), atol=0.1, rtol=0
        )


def assert_other_media_change_the_logprobs(served: tuple, task: str) -> None:
    """The first two held-out prompts ask the same question of other media: the first
    prompt given the second's media answers with other log-probs."""
    engine, _, processor = served
    first, second = task_requests(processor, task, 2)
    assert first.prompt_ids == second.prompt_ids
    swapped = GenerationRequest("swap/0", first.prompt_ids, second.multimodal)
    greedy = SamplingParams(max_new_tokens=1, greedy=True)
    original, other = engine.generate([first, swapped], greedy)
    assert original.logprobs != other.logprobs
