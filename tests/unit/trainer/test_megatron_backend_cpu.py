"""``MegatronBackend`` on CPU, one gloo process: what the backend-neutral conformance test
(test_backend_conformance.py) cannot see, Megatron's own checkpoint folders, schedulers
and data-parallel groups.

On CPU ``MegatronModel`` saves a plain DCP checkpoint in its subfolder; Megatron's
torch_dist format needs CUDA (tests/gpu).
"""

from __future__ import annotations

import megatron.core  # noqa: F401  (the test extra installs it: missing fails, never skips)
import pytest
import torch
from megatron_factories import tiny_qwen3

from relax_hpc.checkpoint.store import CheckpointStore, latest_checkpoint
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.backend import HFNetworks, Networks, make_backend

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CPU = torch.device("cpu")


def megatron_backend(seed: int = 0):
    """A trainable policy and critic (the critic's body from another HF model)."""
    trainer = TrainerConfig(backend="megatron", lr=1e-2, critic_lr=1e-2, warmup_steps=2)
    built = make_backend(trainer, CPU, torch.float32, rank=0, world_size=1)
    built.build_networks(
        HFNetworks(policy=tiny_qwen3(False, seed), critic_body=tiny_qwen3(False, seed + 10))
    )
    return built


def critic_values(nets: Networks, input_ids_BL: torch.Tensor) -> torch.Tensor:
    return nets.critic._forward(nets.critic.network, input_ids_BL)


def train_one_step(nets: Networks, input_ids_BL: torch.Tensor) -> None:
    nets.policy.zero_grad()
    nets.policy.logits(input_ids_BL).logsumexp(-1).mean().backward()
    nets.policy.optimizer_step()
    nets.critic.zero_grad()
    (critic_values(nets, input_ids_BL) - 1.0).pow(2).mean().backward()
    nets.critic.optimizer_step()


def assert_same_outputs(left: Networks, right: Networks, input_ids_BL: torch.Tensor) -> None:
    with torch.no_grad():
        assert torch.equal(left.policy.logits(input_ids_BL), right.policy.logits(input_ids_BL))
        assert torch.equal(critic_values(left, input_ids_BL), critic_values(right, input_ids_BL))


def test_checkpoint_folders_and_schedulers_round_trip_through_the_store(megatron_world, tmp_path):
    paths = RunPaths(tmp_path / "run")
    store = CheckpointStore(paths, keep=2)
    input_ids_BL = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    saved = megatron_backend()
    train_one_step(saved.nets, input_ids_BL)
    assert critic_values(saved.nets, input_ids_BL).abs().sum() > 0  # the head moved off zero
    store.save(1, saved.checkpoint_entries(store.partial_dir(1), saving=True))

    info = latest_checkpoint(paths)
    assert info is not None and info.step == 1
    assert (info.path / "megatron").is_dir()  # inside the folder marked COMPLETE
    assert (info.path / "megatron_critic").is_dir()
    assert not list(paths.checkpoints_dir.glob("*.partial"))

    fresh = megatron_backend(seed=1)
    store.load(info, fresh.checkpoint_entries(info.path, saving=False))
    assert_same_outputs(fresh.nets, saved.nets, input_ids_BL)
    for role in ("policy", "critic"):
        saved_scheduler = getattr(saved.nets, role).scheduler.state_dict()
        assert getattr(fresh.nets, role).scheduler.state_dict() == saved_scheduler
    # Same optimizer state: one more identical step keeps the two models identical.
    train_one_step(saved.nets, input_ids_BL)
    train_one_step(fresh.nets, input_ids_BL)
    assert_same_outputs(fresh.nets, saved.nets, input_ids_BL)


def test_update_splits_rows_by_the_data_parallel_group(megatron_world):
    # A global rank 3 of 8 (as under TP): the layout comes from Megatron's group (here 0 of 1).
    def layout(backend: str) -> tuple[int, int]:
        trainer = TrainerConfig(backend=backend)
        return make_backend(trainer, CPU, torch.float32, 3, 8).data_parallel_layout()

    assert layout("megatron") == (0, 1)
    assert layout("torch") == (3, 8)  # FSDP2: every rank is a data-parallel rank


def test_checkpoint_records_its_layout_and_refuses_one_it_cannot_serve(megatron_world, tmp_path):
    import json

    from relax_hpc.trainer.megatron.layout import (
        LAYOUT_FILE,
        CheckpointLayout,
        CheckpointLayoutError,
        read_layout,
    )

    input_ids_BL = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    nets = megatron_backend().nets
    train_one_step(nets, input_ids_BL)
    nets.policy.save_checkpoint(tmp_path / "megatron")
    assert read_layout(tmp_path / "megatron") == CheckpointLayout()  # one process, all 1

    record = tmp_path / "megatron" / LAYOUT_FILE
    as_if_tp2 = {**json.loads(record.read_text()), "tensor": 2}
    record.write_text(json.dumps(as_if_tp2))
    fresh = megatron_backend(seed=1).nets
    before = fresh.policy.hf_state_dict()
    with pytest.raises(CheckpointLayoutError, match="tensor 2 -> 1"):
        fresh.policy.load_checkpoint(tmp_path / "megatron")
    after = fresh.policy.hf_state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # nothing read

    record.write_text(json.dumps({**as_if_tp2, "format": "fully_reshardable"}))
    fresh.policy.load_checkpoint(tmp_path / "megatron")
    with torch.no_grad():
        assert torch.equal(fresh.policy.logits(input_ids_BL), nets.policy.logits(input_ids_BL))
