"""``weightsync.transport``: the config field, the sender factory, per-tensor checksums, and
the SGLang side of ``sglang_distributed`` against a stand-in ``sglang.Engine``."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.config.weightsync import run_backend
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.engines.sglang_adapter import SGLangCallFailed
from relax_hpc.rollout.sglang_weights import SGLangDistributedTarget
from relax_hpc.weightsync import (
    PerTensorReceiver,
    PerTensorSender,
    WeightSender,
    WeightSyncConfig,
    WeightVerificationError,
    make_weight_sender,
    protocol,
)
from relax_hpc.weightsync.per_tensor import GroupEndpoint, tensor_checksum


def test_transport_defaults_to_buckets_and_is_validated():
    assert WeightSyncConfig().transport == "buckets"
    assert WeightSyncConfig(transport="sglang_distributed").validate().transport == (
        "sglang_distributed"
    )
    with pytest.raises(ValueError, match=r"^weightsync\.transport='nccl_p2p' is invalid"):
        WeightSyncConfig(transport="nccl_p2p").validate()


@pytest.mark.parametrize(
    ("transport", "backend", "trainer_on_gpu", "expected"),
    [
        ("buckets", "auto", False, "gloo"),
        ("buckets", "auto", True, "gloo"),  # receivers stage in host memory; mode=sync safe
        ("sglang_distributed", "auto", True, "nccl"),
        ("sglang_distributed", "auto", False, "gloo"),
        ("sglang_distributed", "gloo", True, "gloo"),  # an explicit choice is kept
    ],
)
def test_the_run_backend_follows_the_transport(transport, backend, trainer_on_gpu, expected):
    config = WeightSyncConfig(transport=transport, backend=backend)
    assert run_backend(config, trainer_on_gpu) == expected


def test_a_gloo_sender_on_a_cuda_trainer_stages_in_host_memory(tmp_path):
    """The co-located route of mode=sync: no CUDA is touched to build the sender."""
    paths = RunPaths(tmp_path).create()
    gloo = WeightSender(paths, WeightSyncConfig(backend="gloo"), "cuda:0")
    assert (gloo.backend, gloo.device) == ("gloo", torch.device("cpu"))
    nccl = WeightSender(paths, WeightSyncConfig(backend="nccl"), "cuda:0")
    assert (nccl.backend, nccl.device) == ("nccl", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        WeightSender(paths, WeightSyncConfig(backend="nccl"), "cpu")


def test_the_factory_keeps_the_bucket_sender_by_default(tmp_path):
    paths = RunPaths(tmp_path).create()
    assert type(make_weight_sender(paths, WeightSyncConfig())) is WeightSender
    config = WeightSyncConfig(transport="sglang_distributed")
    assert type(make_weight_sender(paths, config)) is PerTensorSender


def test_per_tensor_classes_refuse_the_bucket_transport(tmp_path):
    paths = RunPaths(tmp_path).create()
    with pytest.raises(ValueError, match="transport"):
        PerTensorSender(paths, WeightSyncConfig())
    with pytest.raises(ValueError, match="transport"):
        PerTensorReceiver(paths, "e1", WeightSyncConfig(), engine=None)


@pytest.mark.parametrize(
    "algo", [protocol.CHECKSUM_XXH3, protocol.CHECKSUM_CRC32, protocol.CHECKSUM_WSUM64]
)
@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 5).to(torch.bfloat16),  # 30 bytes: not whole 32-bit words
        torch.arange(7, dtype=torch.int64),
        torch.tensor(2.5),
        torch.tensor([True, False, True]),
    ],
)
def test_tensor_checksum_sees_any_changed_element(algo, tensor):
    base = tensor_checksum(tensor, algo)
    assert tensor_checksum(tensor.clone(), algo) == base
    changed = tensor.clone().reshape(-1)
    changed[-1] = ~changed[-1] if changed.dtype == torch.bool else changed[-1] + 1
    assert tensor_checksum(changed.reshape(tensor.shape), algo) != base


@pytest.fixture
def stand_in_target(sglang_stand_in):
    """A ``SGLangDistributedTarget`` over an engine of 2 TP ranks, and the stand-in."""
    engine, sglang = sglang_stand_in()
    return SGLangDistributedTarget(engine), engine, sglang


SPECS = [
    protocol.TensorSpec("model.embed_tokens.weight", "bfloat16", (64, 8), 0, 0),
    protocol.TensorSpec("lm_head.weight", "bfloat16", (64, 8), 0, 1024),
]


def test_sglang_joins_at_its_rank_offset_and_receives_the_manifest_in_order(stand_in_target):
    target, engine, sglang = stand_in_target
    assert target.num_ranks == 2
    endpoint = GroupEndpoint("10.0.0.1", 29600, 3, 5, "relax_hpc_weights_ab_1", "nccl")
    target.join_group(endpoint)
    target.receive(SPECS)
    assert sglang.calls[0] == (
        "init_weights_update_group",
        {
            "master_address": "10.0.0.1",
            "master_port": 29600,
            "rank_offset": 3,
            "world_size": 5,
            "group_name": "relax_hpc_weights_ab_1",
            "backend": "nccl",
        },
    )
    name, kwargs = sglang.calls[1]
    assert name == "update_weights_from_distributed"
    assert kwargs["names"] == ["model.embed_tokens.weight", "lm_head.weight"]
    assert kwargs["dtypes"] == ["bfloat16", "bfloat16"]
    assert kwargs["shapes"] == [[64, 8], [64, 8]]
    assert kwargs["group_name"] == "relax_hpc_weights_ab_1" and kwargs["flush_cache"] is True
    assert engine.policy_version == 0, "the receiver stamps the version, not the target"
    target.verify(SPECS, [1, 2], protocol.CHECKSUM_WSUM64)
    with pytest.raises(WeightVerificationError):
        target.verify(SPECS, [1], protocol.CHECKSUM_WSUM64)
    target.leave_group("relax_hpc_weights_ab_1")
    assert sglang.calls[-1] == (
        "destroy_weights_update_group",
        {"group_name": "relax_hpc_weights_ab_1"},
    )


def test_a_failed_sglang_update_raises_and_leaving_never_does(stand_in_target):
    target, engine, sglang = stand_in_target
    target.join_group(GroupEndpoint("h", 1, 1, 3, "g", "nccl"))
    sglang.results["update_weights_from_distributed"] = (False, "Failed to update parameter")
    with pytest.raises(SGLangCallFailed, match="Failed to update parameter"):
        target.receive(SPECS)
    sglang.results["destroy_weights_update_group"] = (False, "does not exist")
    target.leave_group("g")  # logged, not raised
    assert engine.policy_version == 0
