"""Shared fixtures. Tests import the package from the checkout (editable install)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tests run on 2 shared cores; one intra-op thread keeps parallel processes fair."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests are skipped, with a reason, where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
