"""``model.reference_path`` and ``model.critic_path`` load those models, else copy the policy."""

from __future__ import annotations

import pytest
import torch

from relax_hpc.config.compose import compose_run_config
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.runtime import TaskIdentity
from relax_hpc.trainer.main import build_backend

OVERRIDES = [
    "+experiment=grpo_tiny",
    "model.warm_start=false",
    "algo=ppo",
    "algo.kl_loss_coef=0.01",
]


def build_networks(cfg):
    identity = TaskIdentity(0, 1, 0, job_id="t", restart_count=0, launcher="none")
    return build_backend(cfg, torch.device("cpu"), identity)[2].nets


def _params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def other_model_dir(tmp_path):
    cfg = compose_run_config(OVERRIDES)
    tokenizer = build_tokenizer(cfg.model)
    other = build_causal_lm(cfg.model, tokenizer, torch.float32, seed=cfg.seed + 7)
    other.save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    return tmp_path / "other", _params(other)


def test_without_paths_reference_and_critic_start_as_the_policy():
    cfg = compose_run_config(OVERRIDES)
    nets = build_networks(cfg)
    policy = _params(nets.policy.network)
    assert _same(_params(nets.reference.network), policy)
    assert _same(_params(nets.critic.network.body), policy)


def test_paths_load_the_reference_and_the_critic_body(other_model_dir):
    folder, other = other_model_dir
    cfg = compose_run_config(
        [*OVERRIDES, f"model.reference_path={folder}", f"model.critic_path={folder}"]
    )
    nets = build_networks(cfg)
    assert _same(_params(nets.reference.network), other)
    assert _same(_params(nets.critic.network.body), other)
    assert not _same(_params(nets.policy.network), other)
