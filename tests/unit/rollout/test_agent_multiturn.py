"""The episode driver with a real tiny Qwen3 model, the transformers engine and real tools."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch
from agent_fixtures import CountdownEnv, RaisingEnv, ScriptedToolEnv, SlowStepEnv
from test_agent_envs import chatml_tokenizer
from tiny_models import TINY_QWEN3 as ARCH

from relax_hpc.config.schema import ModelConfig
from relax_hpc.data.tasks import GuessNumberTask
from relax_hpc.models.build import build_causal_lm
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.rollout.engines.base import SamplingParams
from relax_hpc.rollout.engines.transformers_engine import TransformersEngine
from relax_hpc.rollout.envs import EnvRuntime
from relax_hpc.rollout.envs.guess_number import GuessNumberEnv
from relax_hpc.rollout.multiturn import EpisodeBudget, EpisodeRequest, EpisodeRunner
from relax_hpc.rollout.tools.sandbox import ToolSandbox
from relax_hpc.rollout.trajectory import episode_metrics, to_sample
from relax_hpc.spool.format import read_shard, write_shard_file

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)
OTHER_SEED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=8)


class RecordingEngine(TransformersEngine):
    """The real engine, remembering which request ids each call generated, and when."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[float, list[str]]] = []
        self.lock = threading.Lock()

    def generate(self, requests, params):
        with self.lock:
            self.calls.append((time.monotonic(), [r.sample_id for r in requests]))
        return super().generate(requests, params)


def make_engine(tokenizer) -> RecordingEngine:
    model = build_causal_lm(ModelConfig(name="t", tokenizer="char", arch=ARCH), tokenizer, seed=0)
    return RecordingEngine(model, tokenizer)


@pytest.fixture(scope="module")
def char_engine() -> RecordingEngine:
    return make_engine(build_char_tokenizer())


@pytest.fixture(scope="module")
def tools():
    with ToolSandbox(num_workers=4, timeout_s=10.0) as sandbox:
        warm = {"seconds": 0.3, "text": ""}  # start all four workers now, not inside a test
        for future in [sandbox.submit("agent_fixtures:sleep_then_echo", warm) for _ in range(4)]:
            assert future.result().ok
        yield sandbox


def run_episodes(engine, env_class, rows, budget, runtime=None, params=PARAMS, seed=1):
    tokenizer = engine.tokenizer
    runner = EpisodeRunner(
        engine, ChatFormat(tokenizer), env_class, runtime or EnvRuntime(), budget, seed=seed
    )
    requests = [
        EpisodeRequest(f"{i}/0", tokenizer(row["prompt"])["input_ids"], row)
        for i, row in enumerate(rows)
    ]
    try:
        return runner.run(requests, params)
    finally:
        runner.close()


def guess_rows(count: int) -> list[dict]:
    return list(GuessNumberTask(count, low=1, high=20, split_seed=0))


def recomputed_logprobs(engine, trajectory) -> torch.Tensor:
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(trajectory.prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, torch.tensor(trajectory.response_ids)[:, None]).squeeze(-1)


def test_a_trajectory_interleaves_model_turns_and_masked_observations(char_engine):
    budget = EpisodeBudget(max_turns=4, max_response_tokens=160)
    trajectories = run_episodes(char_engine, GuessNumberEnv, guess_rows(6), budget)
    decode = char_engine.tokenizer.decode
    assert sum(t.num_turns for t in trajectories) > len(trajectories)  # several turns happened
    for t in trajectories:
        assert len(t.response_ids) == len(t.loss_mask) == len(t.rollout_logprobs)
        position = 0
        for turn in t.turns:
            assert turn.start == position
            model = slice(turn.start, turn.start + turn.num_model_tokens)
            observation = slice(model.stop, model.stop + turn.num_observation_tokens)
            assert set(t.loss_mask[model]) == {1} and set(t.loss_mask[observation]) <= {0}
            assert set(t.rollout_logprobs[observation]) <= {0.0}
            if turn.num_observation_tokens:
                text = decode(t.response_ids[observation])
                assert re.fullmatch(r"\nuser: (higher|lower|say a number)\nassistant: ", text)
            position = observation.stop
        assert position == len(t.response_ids) and t.turns[-1].num_observation_tokens == 0
        assert t.end_reason in ("done", "max_turns", "max_tokens")
        # The engine's log-probs of every model token are what one forward pass over the
        # whole trajectory gives (what the trainer recomputes).
        model_positions = torch.tensor(t.loss_mask, dtype=torch.bool)
        expected = recomputed_logprobs(char_engine, t)[model_positions]
        actual = torch.tensor(t.rollout_logprobs)[model_positions]
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)


def test_turns_are_requested_as_distinct_reproducible_samples(char_engine):
    char_engine.calls.clear()
    budget = EpisodeBudget(max_turns=3, max_response_tokens=160)
    first = run_episodes(char_engine, CountdownEnv, [{"prompt": "go:", "turns": 3}] * 3, budget)
    requested = [sid for _, ids in char_engine.calls for sid in ids]
    assert sorted(requested) == sorted(f"{i}/0{s}" for i in range(3) for s in ("", "#t1", "#t2"))
    again = run_episodes(char_engine, CountdownEnv, [{"prompt": "go:", "turns": 3}] * 3, budget)
    for a, b in zip(first, again, strict=True):
        assert (a.response_ids, a.loss_mask, a.reward) == (b.response_ids, b.loss_mask, b.reward)
        assert [vars(x) for x in a.turns] == [vars(x) for x in b.turns]
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)
        assert a.info == b.info  # the environment saw the same episode seed
    rows = [{"prompt": "go:", "turns": 3}] * 3
    other = run_episodes(char_engine, CountdownEnv, rows, budget, params=OTHER_SEED, seed=2)
    assert all(a.response_ids != b.response_ids for a, b in zip(first, other, strict=True))
    assert all(a.info != b.info for a, b in zip(first, other, strict=True))


def test_turn_and_token_budgets_end_episodes(char_engine):
    rows = [{"prompt": "go:", "turns": 10}] * 4
    by_turns = run_episodes(char_engine, CountdownEnv, rows, EpisodeBudget(max_turns=2))
    assert {(t.end_reason, t.num_turns, t.reward) for t in by_turns} == {("max_turns", 2, 0.0)}
    by_tokens = run_episodes(
        char_engine, CountdownEnv, rows, EpisodeBudget(max_turns=10, max_response_tokens=30)
    )
    assert {t.end_reason for t in by_tokens} == {"max_tokens"}
    assert all(len(t.response_ids) <= 30 for t in by_tokens)


def test_the_wall_time_budget_abandons_a_slow_step(char_engine):
    started = time.monotonic()
    rows = [{"prompt": "go:", "turns": 2}] * 2
    trajectories = run_episodes(
        char_engine, SlowStepEnv, rows, EpisodeBudget(max_turns=3, max_wall_s=0.5)
    )
    assert time.monotonic() - started < 4.0  # the steps sleep 5 s
    assert {(t.end_reason, t.num_turns) for t in trajectories} == {("wall_time", 1)}
    assert all(0.5 <= t.wall_s < 4.0 for t in trajectories)


def test_an_environment_that_raises_ends_only_its_episode(char_engine):
    rows = [{"prompt": "go:", "turns": 2, "boom": i == 1} for i in range(3)]
    trajectories = run_episodes(char_engine, RaisingEnv, rows, EpisodeBudget(max_turns=3))
    assert [t.end_reason for t in trajectories] == ["done", "env_error", "done"]
    assert trajectories[1].info["env_error"] == "step raised RuntimeError: environment bug"


def test_a_slow_tool_does_not_idle_the_engine(char_engine, tools):
    char_engine.calls.clear()
    rows = [{"prompt": "go:", "calls": 1, "delay": 2.0}] + [{"prompt": "go:", "calls": 2}] * 3
    started = time.monotonic()
    trajectories = run_episodes(
        char_engine, ScriptedToolEnv, rows, EpisodeBudget(max_turns=4), EnvRuntime(tools=tools)
    )
    when = {sid: at - started for at, ids in char_engine.calls for sid in ids}
    assert all(when[f"{i}/0#t2"] < 2.0 for i in (1, 2, 3)), when  # done while 0/0's tool slept
    assert when["0/0#t1"] >= 2.0
    slow, *fast = trajectories
    assert (slow.num_turns, slow.num_tool_calls, slow.reward) == (2, 1, 1.0)
    assert slow.tool_wall_s >= 2.0
    assert all((t.num_turns, t.num_tool_calls, t.num_tool_errors) == (3, 2, 0) for t in fast)
    first_turn = fast[0].turns[0]
    begin = first_turn.num_model_tokens
    observation = fast[0].response_ids[begin : begin + first_turn.num_observation_tokens]
    assert char_engine.tokenizer.decode(observation) == (
        "\nuser:\n<tool_response>\necho 0\n</tool_response>\nassistant: "
    )


def test_an_end_of_turn_token_closes_the_turn_once():
    tokenizer = chatml_tokenizer()
    engine = make_engine(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [{"prompt": "<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n", "turns": 3}] * 16
    params = SamplingParams(temperature=1.5, max_new_tokens=25, seed=3)
    trajectories = run_episodes(
        engine, CountdownEnv, rows, EpisodeBudget(max_turns=3), params=params
    )
    seen = set()
    for t in trajectories:
        for turn in t.turns[:-1]:
            last = t.response_ids[turn.start + turn.num_model_tokens - 1]
            begin = turn.start + turn.num_model_tokens
            text = tokenizer.decode(t.response_ids[begin : begin + turn.num_observation_tokens])
            closing = "\n" if last == im_end else "<|im_end|>\n"
            assert text == closing + "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
            seen.add(last == im_end)
    assert seen == {True, False}, "the seed should give turns ended both ways"


def test_trajectories_go_through_the_spool_format_unchanged(char_engine, tools, tmp_path):
    rows = [{"prompt": "go:", "calls": 1}, {"prompt": "go:", "calls": 2}]
    trajectories = run_episodes(
        char_engine, ScriptedToolEnv, rows, EpisodeBudget(max_turns=4), EnvRuntime(tools=tools)
    )
    samples = [to_sample(t, group_id="5", data_index=5) for t in trajectories]
    write_shard_file(tmp_path / "shard.h5", [samples], writer_id="test", created_unix_s=0.0)
    _, groups = read_shard(tmp_path / "shard.h5")
    for t, back in zip(trajectories, groups[0], strict=True):
        assert back.response_token_ids.tolist() == t.response_ids
        assert back.loss_mask.tolist() == t.loss_mask
        np.testing.assert_allclose(back.rollout_logprobs, t.rollout_logprobs, atol=1e-6)
        assert (back.num_turns, back.finish_reason, back.reward) == (t.num_turns, "done", 1.0)
        assert back.metadata["turns"] == [
            [x.start, x.num_model_tokens, x.num_observation_tokens] for x in t.turns
        ]
        assert (
            back.metadata["tool_calls"] == t.num_tool_calls and back.metadata["tool_status"] == {}
        )
    metrics = episode_metrics(trajectories)
    assert metrics["agent/turns_mean"] == 2.5 and metrics["agent/tool_calls_mean"] == 1.5
    assert metrics["agent/end_done"] == 1.0 and metrics["agent/tool_error_rate"] == 0.0
    assert 0 < metrics["agent/observation_token_share"] < 1
