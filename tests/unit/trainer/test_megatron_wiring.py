"""The megatron branch of the trainer wiring (relax_hpc/trainer/main.py) on CPU, one gloo process.

Checkpoints go through the functions ``run_trainer`` uses (``_checkpoint_state`` with
``megatron_entries_to_save``/``_load``, ``CheckpointStore``). On CPU ``MegatronModel`` saves a
plain DCP checkpoint in its subfolder; Megatron's torch_dist format needs CUDA (tests/gpu).
"""

from __future__ import annotations

import megatron.core  # noqa: F401  (the test extra installs it: missing fails, never skips)
import pytest
import torch
from megatron_factories import tiny_qwen3

from relax_hpc.checkpoint.store import CheckpointStore, latest_checkpoint
from relax_hpc.config.schema import RunConfig, TrainerConfig
from relax_hpc.paths import RunPaths
from relax_hpc.trainer.loop import Progress
from relax_hpc.trainer.update import Networks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

CPU = torch.device("cpu")
CFG = RunConfig(name="wiring", trainer=TrainerConfig(backend="megatron"))


def megatron_nets(settings, seed: int = 0) -> Networks:
    """A trainable policy and critic (the critic's body from another HF model)."""
    from relax_hpc.trainer.megatron.backend import OptimizerSettings, megatron_model_from_hf

    optim = OptimizerSettings(lr=1e-2, warmup_steps=2)
    policy = megatron_model_from_hf(tiny_qwen3(False, seed), settings, CPU, 64, optim)
    critic_body = tiny_qwen3(False, seed + 10)
    critic = megatron_model_from_hf(critic_body, settings, CPU, 64, optim, critic=True)
    return Networks(policy=policy, critic=critic)


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


def test_checkpoint_round_trip_through_the_store(megatron_world, tmp_path):
    from relax_hpc.trainer.main import (
        _checkpoint_state,
        megatron_entries_to_load,
        megatron_entries_to_save,
    )

    paths = RunPaths(tmp_path / "run")
    input_ids_BL = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    nets, progress = megatron_nets(megatron_world), Progress(step=1)
    train_one_step(nets, input_ids_BL)
    assert critic_values(nets, input_ids_BL).abs().sum() > 0  # the head moved off zero
    entries = megatron_entries_to_save(CFG, nets, paths, 1)
    CheckpointStore(paths, keep=2).save(1, _checkpoint_state(nets, progress, None, entries))

    info = latest_checkpoint(paths)
    assert info is not None and info.step == 1
    assert (info.path / "megatron").is_dir()  # inside the folder marked COMPLETE
    assert (info.path / "megatron_critic").is_dir()
    assert not list(paths.checkpoints_dir.glob("*.partial"))

    fresh, fresh_progress = megatron_nets(megatron_world, seed=1), Progress()
    entries = megatron_entries_to_load(CFG, fresh, info.path)
    CheckpointStore(paths, keep=2).load(
        info, _checkpoint_state(fresh, fresh_progress, None, entries)
    )
    assert fresh_progress.step == 1
    assert_same_outputs(fresh, nets, input_ids_BL)
    assert fresh.policy.scheduler.state_dict() == nets.policy.scheduler.state_dict()
    # Same optimizer state: one more identical step keeps the two models identical.
    train_one_step(nets, input_ids_BL)
    train_one_step(fresh, input_ids_BL)
    assert_same_outputs(fresh, nets, input_ids_BL)


def test_sync_weights_are_the_hf_models(megatron_world):
    from relax_hpc.trainer.main import policy_weights

    nets = megatron_nets(megatron_world, seed=2)
    expected = tiny_qwen3(False, seed=2).state_dict()
    weights = policy_weights(CFG, nets, world_size=1)
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_update_splits_rows_by_the_data_parallel_group(megatron_world):
    from relax_hpc.runtime import TaskIdentity
    from relax_hpc.trainer.main import data_parallel_layout

    # A global rank 3 of 8 (as under TP): the layout comes from Megatron's group (here 0 of 1).
    identity = TaskIdentity(3, 8, 3, job_id="local-1", restart_count=0, launcher="none")
    assert data_parallel_layout(CFG, identity) == (0, 1)
    torch_cfg = RunConfig(name="wiring", trainer=TrainerConfig(backend="torch"))
    assert data_parallel_layout(torch_cfg, identity) == (3, 8)


def test_checkpoint_records_its_layout_and_refuses_one_it_cannot_serve(megatron_world, tmp_path):
    import json

    from relax_hpc.trainer.megatron.layout import (
        LAYOUT_FILE,
        CheckpointLayout,
        CheckpointLayoutError,
        read_layout,
    )

    input_ids_BL = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    nets = megatron_nets(megatron_world)
    train_one_step(nets, input_ids_BL)
    nets.policy.save_checkpoint(tmp_path / "megatron")
    assert read_layout(tmp_path / "megatron") == CheckpointLayout()  # one process, all 1

    record = tmp_path / "megatron" / LAYOUT_FILE
    as_if_tp2 = {**json.loads(record.read_text()), "tensor": 2}
    record.write_text(json.dumps(as_if_tp2))
    fresh = megatron_nets(megatron_world, seed=1)
    before = fresh.policy.hf_state_dict()
    with pytest.raises(CheckpointLayoutError, match="tensor 2 -> 1"):
        fresh.policy.load_checkpoint(tmp_path / "megatron")
    after = fresh.policy.hf_state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # nothing read

    record.write_text(json.dumps({**as_if_tp2, "format": "fully_reshardable"}))
    fresh.policy.load_checkpoint(tmp_path / "megatron")
    with torch.no_grad():
        assert torch.equal(fresh.policy.logits(input_ids_BL), nets.policy.logits(input_ids_BL))
