"""Samples whose reward failed train with no weight: the real trainer loop, through the real
spool, on groups scored by a reward that fails on a known third of the samples.

Those samples carry no gradient (the loss's gradient wrt their log-probs is 0), their
group's statistics leave them out (a group left with one scored sample is dropped), the
counts reach TensorBoard (read back with TensorBoard's reader) and every sample, failed or
not, is consumed exactly once.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from loop_fixtures import loop_settings
from megatron_factories import TINY_QWEN3, tiny_qwen3
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from relax_hpc import exitcodes
from relax_hpc.algo import AlgoConfig, resolve
from relax_hpc.checkpoint.stop import StopFlag
from relax_hpc.checkpoint.store import CheckpointStore
from relax_hpc.config.schema import TrainerConfig
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.paths import RunPaths
from relax_hpc.rollout.rewards.result import call_reward
from relax_hpc.rollout.scoring import SampleScorer
from relax_hpc.spool import Sample, ShardWriter, SpoolReader
from relax_hpc.trainer.backend import HFNetworks, make_backend
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.loop import Trainer, sequential_broadcast
from relax_hpc.trainer.update import _actor_micro_loss, mask_failed_rewards, prepare_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
STEPS, GROUPS_PER_STEP, PER_GROUP = 3, 3, 3


def flaky_reward(completion: str, answer: str, metadata) -> float:
    """Times out on a known third of each step's samples: two of its first group (which
    keeps one scored sample: dropped), none of its second, one of its third."""
    n, group = metadata["n"], metadata["group"]
    if n < (2, 0, 1)[group % GROUPS_PER_STEP]:
        raise TimeoutError("the judge did not answer within 30 s")
    return float((n + group) % 2)


class FlakyScorer:
    def score(self, items):
        return [call_reward(flaky_reward, i.completion, i.answer, i.metadata) for i in items]

    def close(self) -> None:
        return None


def scored_groups() -> list[list[Sample]]:
    """Groups as the rollout writes them, rewards and details from its ``SampleScorer``."""
    rng = np.random.default_rng(0)
    scorer = SampleScorer(FlakyScorer())
    groups = []
    for g in range(STEPS * GROUPS_PER_STEP):
        pairs = [
            (
                SimpleNamespace(text=f"r{n}"),
                SimpleNamespace(answer="", prompt="", metadata={"n": n, "group": g}),
            )
            for n in range(PER_GROUP)
        ]
        prompt = rng.integers(1, TINY_QWEN3["vocab_size"], 5, dtype=np.int32)
        group = []
        for n, (reward, details) in enumerate(scorer(pairs)):
            length = int(rng.integers(2, 6))
            group.append(
                Sample(
                    sample_id=f"{g}/{n}",
                    group_id=str(g),
                    data_index=g,
                    prompt_token_ids=prompt,
                    response_token_ids=rng.integers(1, 100, length, dtype=np.int32),
                    loss_mask=np.ones(length, dtype=np.uint8),
                    rollout_logprobs=-rng.random(length, dtype=np.float32),
                    reward=reward,
                    policy_version=0,
                    finish_reason="stop",
                    reward_details=details,
                )
            )
        groups.append(group)
    return groups


def make_backend_of(algo: AlgoConfig):
    backend = make_backend(
        TrainerConfig(lr=1e-2, micro_batch_tokens=64), torch.device("cpu"), torch.float32, 0, 1
    )
    backend.build_networks(HFNetworks(policy=tiny_qwen3(True)))
    return backend


def test_failed_samples_carry_no_gradient():
    spec = resolve(AlgoConfig(name="grpo"))
    backend = make_backend_of(spec.config)
    batch = collate(scored_groups()[:GROUPS_PER_STEP], pad_token_id=0)
    failed = batch.reward_failed_B
    assert failed.tolist() == [True, True, False] + [False] * 3 + [True, False, False]
    trained, counts = mask_failed_rewards(spec, batch)
    assert counts == {"rewards/failed_samples": 3.0, "rewards/dropped_groups": 1.0}
    tensors = prepare_step(spec, trained, backend.nets, 1.0)
    assert not tensors.advantages_BT[:3].any()  # the dropped group: no baseline, nothing
    logprobs = tensors.old_logprobs_BT.clone().requires_grad_(True)
    counts_global = (
        int(trained.response_mask_BT.sum()),
        int((trained.response_mask_BT.sum(1) > 0).sum()),
    )
    loss_fn = _actor_micro_loss(
        spec, tensors, [torch.arange(batch.num_samples)], [trained], counts_global, 1
    )
    loss, _ = loss_fn(0, logprobs, torch.zeros_like(logprobs))
    loss.backward()
    untrained = failed.clone()
    untrained[:3] = True
    assert not logprobs.grad[untrained].any()  # failed, or left without a baseline
    assert logprobs.grad[~untrained].abs().sum(-1).gt(0).all()  # the others all learn


def test_the_loop_masks_failed_rewards_counts_them_and_consumes_all_once(tmp_path):
    groups = scored_groups()
    paths = RunPaths(tmp_path).create()
    ShardWriter(paths.spool_dir, "w0", shard_max_samples=PER_GROUP).publish(groups)
    settings = loop_settings(STEPS, GROUPS_PER_STEP, STEPS, audit_sample_ids=True)
    tensorboard_dir = tmp_path / "tb"
    metrics = MetricsLogger(tensorboard_dir, paths.trainer_status)
    trainer = Trainer(
        settings=settings,
        spec=resolve(AlgoConfig(name="grpo")),
        backend=make_backend_of(AlgoConfig(name="grpo")),
        reader=SpoolReader(paths.spool_dir),
        publish_weights=lambda version: {},
        store=CheckpointStore(paths, keep=1),
        stop=StopFlag(),
        metrics=metrics,
        broadcast_groups=sequential_broadcast,
    )
    assert trainer.run() == exitcodes.DONE
    metrics.close()
    trained_ids = sorted(i for step in trainer.progress.sample_ids for i in step)
    assert trained_ids == sorted(s.sample_id for g in groups for s in g)  # each once
    accumulator = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    accumulator.Reload()

    def series(tag: str) -> list[float]:
        return [event.value for event in accumulator.Scalars(tag)]

    assert series("rewards/failed_samples") == [3.0] * STEPS  # a third of each step's 9
    assert series("rewards/dropped_groups") == [1.0] * STEPS
    assert series("rewards/failed_samples_total") == [3.0, 6.0, 9.0]
    assert series("rewards/dropped_groups_total") == [1.0, 2.0, 3.0]
    assert trainer.progress.samples == STEPS * GROUPS_PER_STEP * PER_GROUP


def test_the_flag_reads_from_old_shards_and_from_episodes():
    from relax_hpc.rollout.trajectory import Trajectory, to_sample

    (sample,) = scored_groups()[0][:1]
    assert sample.reward_failed and sample.reward_details["reward_failed"] is True
    old = Sample(**{**sample.__dict__, "reward_details": {"failed": "raised TimeoutError"}})
    assert old.reward_failed  # written before the flag: the reason alone says it
    assert not Sample(**{**sample.__dict__, "reward_details": {"parts": {}}}).reward_failed
    episode = Trajectory("0/0", [1, 2], [3], [1], [-0.5], info={"reward_failed": "raised X"})
    assert to_sample(episode, "0", 0).reward_failed
    assert not to_sample(Trajectory("0/1", [1, 2], [3], [1], [-0.5]), "0", 0).reward_failed
