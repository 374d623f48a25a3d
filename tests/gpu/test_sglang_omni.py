"""SGLangEngine with audio on a real GPU: a tiny random Qwen2.5-Omni thinker saved to a
folder, served by ``sglang.Engine``, given the pitch task's prompts through the rollout's own
path (dataset -> ``media_request`` -> ``sglang_media``: ``audio_data`` items holding
``input_features`` + ``feature_attention_mask``, the media-token ``logit_bias``).

Checks what the CPU tests cannot: that SGLang accepts ``processor_output`` audio beside
pre-expanded ``input_ids`` (``GenerateReqInput.audio_data``), that the clip reaches the model
(greedy tokens and log-probs near the transformers ``MediaTransformersEngine``'s on the same
weights), and that another clip changes the answer's log-probs. Not yet run on a GPU.
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen2.5-omni")
    model, processor = build_tiny_media_model("qwen2_5_omni", ARCH, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # sharper logits: a lost clip shows above bf16 noise
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


def pitch_requests(processor, count: int = 4) -> list[GenerationRequest]:
    data = DataConfig(kind="media_task", media_task="pitch", eval_size=8)
    dataset = build_dataset(data, processor.tokenizer, split="eval", processor=processor)
    return [
        GenerationRequest(f"{i}/0", dataset[i].prompt_ids, media_request(dataset[i].media))
        for i in range(count)
    ]


def test_sglang_generates_from_the_audio_as_the_transformers_engine_does(served):
    engine, model, processor = served
    requests = pitch_requests(processor)
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    served_out = engine.generate(requests, greedy)
    reference = MediaTransformersEngine(model.to("cuda", torch.bfloat16), processor)
    for ours, theirs in zip(served_out, reference.generate(requests, greedy), strict=True):
        assert not set(ours.token_ids) & set(processor.media_token_ids)
        assert ours.token_ids[:2] == theirs.token_ids[:2]  # bf16 may part later
        torch.testing.assert_close(
            torch.tensor(ours.logprobs[:2]), torch.tensor(theirs.logprobs[:2]), atol=0.1, rtol=0
        )


def test_the_clip_changes_what_sglang_computes(served):
    engine, _, processor = served
    first, second = pitch_requests(processor, 2)  # pitch 1 and pitch 2, the same question
    assert first.prompt_ids == second.prompt_ids
    swapped = GenerationRequest("swap/0", first.prompt_ids, second.multimodal)
    original, other = engine.generate(
        [first, swapped], SamplingParams(max_new_tokens=1, greedy=True)
    )
    assert original.logprobs != other.logprobs
