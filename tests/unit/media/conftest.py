"""Tiny VL and Omni models, built once per session for the media tests."""

from __future__ import annotations

import pytest

from relax_hpc.models.multimodal import build_tiny_media_model


@pytest.fixture(scope="session")
def vl():
    """(model, processor) of a tiny Qwen3-VL."""
    return build_tiny_media_model("qwen3_vl", seed=1)


@pytest.fixture(scope="session")
def omni():
    """(model, processor) of a tiny Qwen2.5-Omni thinker."""
    return build_tiny_media_model("qwen2_5_omni", seed=1)
