"""The trainer loop on image prompts, through the real spool: groups whose samples carry
their prompt's images are published as shards, read back by the trainer's ``SpoolReader``,
collated with the policy's processor and trained; checkpoints hold the VL policy and a
resumed trainer has exactly its weights."""

from __future__ import annotations

import pytest
import torch
from loop_fixtures import loop_settings
from media_batches import GRPO, VL, backend_of, sampled_groups

from relax_hpc import exitcodes
from relax_hpc.algo import resolve
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointStore, complete_checkpoints, latest_checkpoint
from relax_hpc.models.media_policy import build_media_policy
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths
from relax_hpc.spool import ShardWriter, SpoolReader
from relax_hpc.trainer.loop import Trainer, sequential_broadcast

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STEPS, GROUPS_PER_STEP, PER_GROUP = 2, 2, 4


def make_trainer(paths: RunPaths, policy, published: list[int]) -> Trainer:
    _, processor = policy
    _, backend = backend_of(policy, micro_batch_tokens=200)
    settings = loop_settings(
        STEPS, GROUPS_PER_STEP, 1, pad_token_id=processor.tokenizer.pad_token_id, audit_sample_ids=True
    )
    return Trainer(
        settings=settings,
        spec=resolve(GRPO),
        backend=backend,
        reader=SpoolReader(paths.spool_dir),
        publish_weights=lambda version: published.append(version) or {},
        store=CheckpointStore(paths, keep=STEPS),
        stop=StopFlag(),
        metrics=MetricsLogger(None, None),
        broadcast_groups=sequential_broadcast,
        media_processor=processor,
    )


def test_the_loop_trains_on_spooled_image_groups_and_resumes(tmp_path):
    policy = build_media_policy(VL, seed=1)
    groups = sampled_groups(*policy, STEPS * GROUPS_PER_STEP, PER_GROUP)
    paths = RunPaths(tmp_path).create()
    ShardWriter(paths.spool_dir, "w0", shard_max_samples=PER_GROUP).publish(groups)
    published: list[int] = []
    trainer = make_trainer(paths, policy, published)
    assert trainer.run() == exitcodes.DONE
    assert published == [1, 2] and trainer.progress.samples == STEPS * GROUPS_PER_STEP * PER_GROUP
    trained_ids = sorted(i for step in trainer.progress.sample_ids for i in step)
    assert trained_ids == sorted(s.sample_id for g in groups for s in g)  # each once
    assert [info.step for info in complete_checkpoints(paths)] == [1, 2]
    weights = trainer.backend.policy_weights()
    initial = policy[0].state_dict()
    assert any(not torch.equal(weights[n], initial[n]) for n in initial if ".visual." in n)
    resumed = make_trainer(paths, policy, [])
    resumed.resume(latest_checkpoint(paths))
    assert resumed.progress.step == STEPS
    for name, value in resumed.backend.policy_weights().items():
        assert torch.equal(value, weights[name]), name
