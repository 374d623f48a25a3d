"""SGLangEngine with images on a real GPU: a tiny random Qwen3-VL saved to a folder, served by
``sglang.Engine``, given the shapes task's prompts through the rollout's own path (dataset ->
``media_request`` -> ``sglang_media`` processor outputs + the media-token ``logit_bias``).

Checks what the CPU tests cannot: that SGLang accepts the ``processor_output`` images beside
pre-expanded ``input_ids``, that the images reach the model (greedy tokens and log-probs
equal the transformers ``MediaTransformersEngine``'s on the same weights, to bf16 tolerance),
that no media token is ever sampled, and that another image changes the answer's log-probs.
Needs one GPU and the ``gpu`` extra (sglang); skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import build_dataset
from relax_hpc.models.multimodal import build_tiny_media_model, save_media_model
from relax_hpc.rollout.engines.base import GenerationRequest, SamplingParams
from relax_hpc.rollout.engines.media_engine import MediaTransformersEngine, media_request
from relax_hpc.rollout.engines.sglang_engine import SGLangEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
sglang = pytest.importorskip("sglang", reason="needs the gpu extra (sglang)")

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
MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-vl")
    model, processor = build_tiny_media_model("qwen3_vl", ARCH, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # sharper logits: a lost image shows above bf16 noise
    save_media_model(folder, model, processor)
    engine = SGLangEngine(
        folder,
        mem_fraction=0.2,
        dtype="bfloat16",
        media_processor=processor,
        extra_server_args={"disable_cuda_graph": True},
    )
    yield engine, model, processor
    engine.shutdown()


def shapes_requests(processor, count: int = 4) -> list[GenerationRequest]:
    data = DataConfig(kind="media_task", media_task="shapes", eval_size=8)
    dataset = build_dataset(data, processor.tokenizer, split="eval", processor=processor)
    records = [dataset[i] for i in range(count)]
    return [
        GenerationRequest(f"{i}/0", r.prompt_ids, media_request(r.media))
        for i, r in enumerate(records)
    ]


def test_sglang_generates_from_the_images_as_the_transformers_engine_does(served):
    engine, model, processor = served
    requests = shapes_requests(processor)
    greedy = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, greedy=True)
    served_out = engine.generate(requests, greedy)
    reference = MediaTransformersEngine(model.to("cuda", torch.bfloat16), processor)
    local_out = reference.generate(requests, greedy)
    for ours, theirs in zip(served_out, local_out, strict=True):
        assert not set(ours.token_ids) & set(processor.media_token_ids)
        assert ours.token_ids[:2] == theirs.token_ids[:2]  # bf16 may part later
        torch.testing.assert_close(
            torch.tensor(ours.logprobs[:2]), torch.tensor(theirs.logprobs[:2]), atol=0.1, rtol=0
        )


def test_the_image_changes_what_sglang_computes(served):
    engine, _, processor = served
    first, second = shapes_requests(processor, 2)
    swapped = GenerationRequest("swap/0", first.prompt_ids, second.multimodal)
    assert first.prompt_ids == second.prompt_ids  # the same question, another 64x64 image
    greedy = SamplingParams(max_new_tokens=1, greedy=True)
    original, other = engine.generate([first, swapped], greedy)
    assert original.logprobs != other.logprobs
