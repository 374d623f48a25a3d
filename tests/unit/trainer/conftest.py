"""A single-process Megatron parallel state (gloo, TP=PP=1), torn down after its module."""

from __future__ import annotations

import warnings

import pytest
import torch
from megatron_factories import free_loopback_port


@pytest.fixture(scope="module")
def megatron_world():
    """Megatron's global parallel state for one gloo process (TP=PP=1), destroyed after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax_hpc.trainer.megatron.model import MegatronSettings, initialize_model_parallel

    # megatron-core is a test dependency: a missing one fails here, never skips
    assert not dist.is_initialized(), "a process group from another test is still alive"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Apex/TE not installed" fallbacks, expected on CPU
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_loopback_port()}", rank=0, world_size=1
        )
        settings = MegatronSettings(dtype=torch.float32, on_cpu=True)
        initialize_model_parallel(settings)
    try:
        yield settings
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
