"""The episode path of the rollout loop: RolloutWorker with an environment, end to end in one
process (a real tiny model and engine, the guess_number environment and dataset, a real
spool writer and TensorBoard writer; the weight receiver is the stand-in of
test_colocated_memory, which plays the trainer's side)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_colocated_memory import TrainerSide, tiny_model

from relax_hpc.config import RunConfig
from relax_hpc.config.compose import compose_run_config
from relax_hpc.config.schema import DataConfig
from relax_hpc.data.datasets import PromptRecord, build_dataset
from relax_hpc.data.sampler import PromptSampler
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.observe.metrics import MetricsLogger
from relax_hpc.rollout.assignment import GroupAssignment
from relax_hpc.rollout.engines.base import SamplingParams
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.rollout.episodes import EpisodeRollout, build_episode_rollout, environment_row
from relax_hpc.rollout.loop import RolloutSettings, RolloutWorker
from relax_hpc.spool import ShardWriter, read_shard
from relax_hpc.spool.layout import SHARD_SUFFIX

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
GUESS = ["+experiment=grpo_tiny_guess", "rollout.max_turns=3", "rollout.max_episode_tokens=64"]


def guess_config(*overrides: str) -> RunConfig:
    return compose_run_config([*GUESS, *overrides])


@pytest.fixture()
def engine() -> TransformersEngine:
    return TransformersEngine(tiny_model(seed=0), build_char_tokenizer())


def worker(cfg: RunConfig, engine, episodes, tmp_path, trainer, batches: int) -> RolloutWorker:
    tokenizer = engine.tokenizer
    return RolloutWorker(
        settings=RolloutSettings(2, 3, max_staleness=0, eval_interval_steps=0, seed=1),
        engine=engine,
        sampler=PromptSampler(build_dataset(cfg.data, tokenizer), seed=1),
        score=lambda pairs: pytest.fail("an environment rewards its own episodes"),
        writer=ShardWriter(tmp_path / "spool", "w0"),
        weights=trainer,
        params=PARAMS,
        metrics=MetricsLogger(tmp_path / "tb", tmp_path / "status.json"),
        assignment=GroupAssignment(tmp_path / "assign", "r0", 2, 2, lease_s=60),
        should_stop=lambda: len(trainer.while_training) > batches,
        episodes=episodes,
    )


def test_a_worker_with_an_environment_publishes_whole_trajectories(tmp_path, engine):
    cfg = guess_config()
    episodes = build_episode_rollout(cfg, engine, engine.tokenizer)
    trainer = TrainerSide(engine)
    try:
        assert worker(cfg, engine, episodes, tmp_path, trainer, batches=2).run() == 0
    finally:
        episodes.close()
    shards = sorted((tmp_path / "spool" / "ready").glob(f"*{SHARD_SUFFIX}"))  # by time
    groups = [g for shard in shards for g in read_shard(shard)[1]]
    assert [[s.sample_id for s in g] for g in groups] == [
        [f"{g}/{j}" for j in range(3)] for g in range(6)
    ]
    for group in groups:
        assert len({s.data_index for s in group}) == 1  # one task per group
        for sample in group:
            assert sample.finish_reason in ("done", "max_turns", "max_tokens")
            layout = np.array(sample.metadata["turns"])
            assert layout[:, 1:].sum() == len(sample.response_token_ids)
            assert sample.metadata["observation_tokens"] == int((sample.loss_mask == 0).sum())
            assert sample.num_turns == len(layout) and sample.num_turns > 1
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["metrics"]["agent/turns_mean"] > 1
    assert 0 < status["metrics"]["agent/observation_token_share"] < 1


def test_a_rerun_of_a_batch_replays_its_episodes(engine):
    """What a rollout restarted after a crash regenerates: the same samples, bit for bit."""
    cfg = guess_config()
    records = build_dataset(cfg.data, engine.tokenizer)
    prompts = [(g, (g, records[g])) for g in (5, 9)]
    runs = []
    for _ in range(2):
        episodes = build_episode_rollout(cfg, engine, engine.tokenizer)
        runs.append(episodes.generate(prompts, 3, PARAMS))
        episodes.close()
    for first, second in zip(*runs, strict=True):
        for a, b in zip(first, second, strict=True):
            assert a.sample_id == b.sample_id and a.group_id == b.group_id
            assert np.array_equal(a.response_token_ids, b.response_token_ids)
            assert np.array_equal(a.loss_mask, b.loss_mask) and a.reward == b.reward
    assert {s.group_id for g in runs[0] for s in g} == {"5", "9"}


def test_the_eval_runs_greedy_episodes(engine):
    cfg = guess_config()
    episodes = build_episode_rollout(cfg, engine, engine.tokenizer)
    records = build_dataset(cfg.data, engine.tokenizer, split="eval")
    results = episodes.evaluate([records[i] for i in range(4)], SamplingParams(greedy=True))
    episodes.close()
    assert set(results) == {
        "eval/accuracy",
        "eval/reward_mean",
        "eval/tool_call_rate",
        "eval/turns_mean",
    }
    assert results["eval/tool_call_rate"] == 0 and results["eval/turns_mean"] >= 1


def test_single_turn_runs_build_no_episode_path_and_tool_environments_a_sandbox(engine):
    assert (
        build_episode_rollout(compose_run_config(["+experiment=grpo_tiny"]), engine, None) is None
    )
    guess = build_episode_rollout(guess_config(), engine, engine.tokenizer)
    calculator = build_episode_rollout(
        compose_run_config(["+experiment=grpo_tiny_calculator", "rollout.tools.num_workers=1"]),
        engine,
        engine.tokenizer,
    )
    try:
        assert isinstance(guess, EpisodeRollout) and guess.sandbox is None
        assert calculator.sandbox is not None
        assert (
            calculator.sandbox.run(
                "relax_hpc.rollout.envs.calculator:calculate", {"expr": "2+3"}
            ).output
            == "5"
        )
    finally:
        guess.close()
        calculator.close()
    with pytest.raises(RuntimeError, match="closed"):
        calculator.sandbox.submit("relax_hpc.rollout.envs.calculator:calculate", {"expr": "1"})


def test_an_environment_sees_the_prompt_as_the_data_holds_it():
    messages = [{"role": "user", "content": "What is 2+2?"}]
    record = PromptRecord("rendered", [1, 2], "4", {"level": 3}, source_prompt=messages)
    assert environment_row(record) == {"prompt": messages, "answer": "4", "level": 3}
    by_hand = PromptRecord("7+8=", [1, 2], "51")
    assert environment_row(by_hand)["prompt"] == "7+8="
    rows = build_dataset(
        DataConfig(kind="guess_number", guess_range=[3, 9]), build_char_tokenizer()
    )
    row = environment_row(rows[0])
    assert row["prompt"] == "guess 3-9:" and 3 <= row["secret"] <= 9
