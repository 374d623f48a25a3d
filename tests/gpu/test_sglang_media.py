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
    with served_tiny_media_model(tmp_path_factory.mktemp("tiny-qwen3-vl"), "qwen3_vl") as served:
        yield served


def test_sglang_generates_from_the_images_as_the_transformers_engine_does(served):
    assert_generates_as_transformers(served, "shapes", max_new_tokens=6)


def test_the_image_changes_what_sglang_computes(served):
    assert_other_media_change_the_logprobs(served, "shapes")  # another 64x64 image
