"""Every algorithm trains on multi-turn trajectories, grouped by task.

The trajectories are real episodes: a tiny model on the transformers engine plays several
turns of an environment whose replies are observation tokens (mask 0); ``to_sample`` maps
them onto spool samples, one group per task. Each algorithm then takes one trainer step
through the trainer's own code: the networks it needs (``hf_networks``, the torch
backend), ``collate``, ``prepare_step``, ``update_policy`` and ``update_critic``. Group-based
estimators must baseline each trajectory against the trajectories of its own task: shifting
one task's rewards by a constant changes no advantage. (The loss-level properties of the
masks - no gradient, no count - are tests/unit/trainer/test_agent_loss_masks.py.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from relax_hpc.algo import resolve
from relax_hpc.config.algo import ALGORITHM_NAMES
from relax_hpc.config.compose import compose_run_config
from relax_hpc.models.build import build_causal_lm
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.rollout.engines.base import SamplingParams
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.rollout.envs import Action, Environment, EnvRuntime, Observation, StepResult
from relax_hpc.rollout.multiturn import EpisodeBudget, EpisodeRequest, EpisodeRunner
from relax_hpc.rollout.trajectory import to_sample
from relax_hpc.trainer.backend import make_backend
from relax_hpc.trainer.batch import collate
from relax_hpc.trainer.networks import hf_networks
from relax_hpc.trainer.update import prepare_step, update_critic, update_policy

TASKS, PER_TASK = 3, 4


class Chatter(Environment):
    """Two observations ("go on"), then a reward: distinct characters the model wrote / 10."""

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        self.written = ""
        return None

    def step(self, action: Action) -> StepResult:
        self.written += action.text
        if action.turn < 2:
            return StepResult(Observation(({"role": "user", "content": "go on"},)))
        return StepResult(reward=len(set(self.written)) / 10, done=True)


def base_config(*overrides: str):
    return compose_run_config(["+experiment=grpo_tiny", "model.warm_start=false", *overrides])


@pytest.fixture(scope="module")
def groups():
    cfg = base_config()
    tokenizer = build_char_tokenizer()
    engine = TransformersEngine(build_causal_lm(cfg.model, tokenizer, seed=3), tokenizer)
    runner = EpisodeRunner(
        engine, ChatFormat(tokenizer), Chatter, EnvRuntime(), EpisodeBudget(3, 64), seed=1
    )
    requests = [
        EpisodeRequest(f"{g}/{j}", tokenizer(f"task {g}:")["input_ids"], {"prompt": f"task {g}:"})
        for g in range(TASKS)
        for j in range(PER_TASK)
    ]
    trajectories = runner.run(requests, SamplingParams(temperature=1.0, max_new_tokens=5, seed=2))
    runner.close()
    assert all(t.num_turns == 3 and t.num_observation_tokens > 0 for t in trajectories)
    samples = [to_sample(t, t.sample_id.split("/")[0], int(t.sample_id[0])) for t in trajectories]
    return [samples[g * PER_TASK : (g + 1) * PER_TASK] for g in range(TASKS)]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    cfg = base_config()
    tokenizer = build_char_tokenizer()
    build_causal_lm(cfg.model, tokenizer, seed=5).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ALGORITHM_NAMES)
def test_every_algorithm_trains_on_multi_turn_trajectories(name, groups, teacher_dir):
    extra = [f"model.teacher_path={teacher_dir}"] if name == "opd" else []
    cfg = base_config(f"algo={name}", "trainer.lr=1e-3", *extra)
    spec = resolve(cfg.algo)
    networks, tokenizer = hf_networks(cfg, spec, torch.float32)
    backend = make_backend(cfg.trainer, torch.device("cpu"), torch.float32, 0, 1)
    nets = backend.build_networks(networks)
    batch = collate(groups, tokenizer.pad_token_id)
    assert batch.group_index_B.tolist() == [g for g in range(TASKS) for _ in range(PER_TASK)]
    tensors = prepare_step(spec, batch, nets, 1.0)
    observation = (batch.response_mask_BT == 0) & (
        torch.arange(batch.response_mask_BT.shape[1]) < batch.response_len_B[:, None]
    )
    assert observation.any() and not tensors.advantages_BT[observation].any()
    before = [p.detach().clone() for p in nets.policy.network.parameters()]
    metrics = update_policy(spec, batch, tensors, nets.policy, (1, 1, 0, 1), 1.0)
    if nets.critic is not None:
        metrics.update(update_critic(spec, batch, tensors, nets.critic, (1, 1, 0, 1)))
        assert "loss/critic" in metrics
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    after = list(nets.policy.network.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    if cfg.algo.is_group_based():
        shifted = collate(groups, tokenizer.pad_token_id)
        shifted.rewards_B[batch.group_index_B == 1] += 5.0  # one task's rewards only
        again = prepare_step(spec, shifted, nets, 1.0)
        moved = prepare_step(spec, batch, nets, 1.0)  # the same step, for the float noise
        torch.testing.assert_close(again.advantages_BT, moved.advantages_BT, atol=1e-4, rtol=0)
