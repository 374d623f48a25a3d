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
from sglang_media_checks import (
    assert_generates_as_transformers,
    assert_other_media_change_the_logprobs,
    served_tiny_media_model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
sglang = pytest.importorskip("sglang", reason="needs the gpu extra (sglang)")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_tiny_media_model(
        tmp_path_factory.mktemp("tiny-qwen2.5-omni"), "qwen2_5_omni"
    ) as served:
        yield served


def test_sglang_generates_from_the_audio_as_the_transformers_engine_does(served):
    assert_generates_as_transformers(served, "pitch", max_new_tokens=4)


def test_the_clip_changes_what_sglang_computes(served):
    assert_other_media_change_the_logprobs(served, "pitch")  # pitch 1, then pitch 2
