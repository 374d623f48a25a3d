"""The agent recipes' warm starts: their demonstrations are episodes exactly as the episode
driver writes them, and each recipe trains, caches and keys like grpo_tiny's.

The layout check replays a demonstration's model turns through ``EpisodeRunner`` with the
real environment (and, for the calculator, the real tool sandbox): a replaying engine
stands in for sampling, because no model can be made to write given tokens on demand.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence

import pytest
from test_task_addition import ARCH

from relax_hpc.config.schema import DataConfig, ModelConfig
from relax_hpc.models.build import build_causal_lm, build_tokenizer
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.models.tokenizer import TOOL_TAGS, build_char_tokenizer
from relax_hpc.rollout.engines.base import Completion, Engine, GenerationRequest, SamplingParams
from relax_hpc.rollout.envs import EnvRuntime
from relax_hpc.rollout.envs.calculator import CalculatorEnv
from relax_hpc.rollout.envs.guess_number import GuessNumberEnv
from relax_hpc.rollout.multiturn import EpisodeBudget, EpisodeRequest, EpisodeRunner
from relax_hpc.rollout.tools.sandbox import ToolSandbox
from relax_hpc.tasks.addition import warm_start
from relax_hpc.tasks.calculator import (
    ToolWarmStartConfig,
    calculator_demonstration,
    calculator_warm_start,
)
from relax_hpc.tasks.guess import GuessWarmStartConfig, guess_demonstration, guess_warm_start
from relax_hpc.tasks.registry import policy_task
from relax_hpc.tasks.warm_start import warm_started_model_config

ADDITION = DataConfig(kind="synthetic_addition", digits=1, eval_size=10, apply_chat_template=False)
GUESS = DataConfig(kind="guess_number", guess_range=[1, 20])


class ReplayEngine(Engine):
    """Answers turn k of every request with ``turns[k]`` (token ids), as an engine would."""

    def __init__(self, tokenizer, turns: Sequence[list[int]], stop: str | None) -> None:
        self.tokenizer, self.turns, self.stop = tokenizer, turns, stop

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams):
        completions = []
        for request in requests:
            turn = int(request.sample_id.partition("#t")[2] or 0)
            tokens = self.turns[turn]
            ends_at_stop = tokens[-1] != self.tokenizer.eos_token_id
            completions.append(
                Completion(
                    request.sample_id,
                    request.prompt_ids,
                    tokens,
                    [-0.5] * len(tokens),
                    "stop",
                    self.tokenizer.decode(tokens, skip_special_tokens=True),
                    0,
                    stop=self.stop if ends_at_stop else None,
                )
            )
        return completions

    def load_state_dict(self, named_tensors, policy_version: int) -> None:
        raise NotImplementedError


def model_turns(ids: list[int], labels: list[int]) -> list[list[int]]:
    """The runs of labelled tokens: the demonstration's model turns."""
    turns, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != -100:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    return [*turns, current] if current else turns


def replay(env_class, runtime, chat, ids, labels, row, stop=None, max_turns=2):
    """The trajectory the episode driver writes when the model writes the demo's turns."""
    prompt_length = labels.index(next(label for label in labels if label != -100))
    engine = ReplayEngine(chat.tokenizer, model_turns(ids, labels), stop)
    runner = EpisodeRunner(engine, chat, env_class, runtime, EpisodeBudget(max_turns, 512), seed=1)
    request = EpisodeRequest("0/0", ids[:prompt_length], row)
    trajectory = runner.run([request], SamplingParams(max_new_tokens=64))[0]
    runner.close()
    return prompt_length, trajectory


def test_the_char_tools_tokenizer_has_the_tool_tags_as_single_tokens():
    tokenizer = build_char_tokenizer(tool_tags=True)
    ids = [tokenizer.convert_tokens_to_ids(tag) for tag in TOOL_TAGS]
    assert ids == [101, 102, 103, 104] and len(tokenizer) == 105
    text = '<tool_call>{"name":"calc"}</tool_call>'
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encoded[0] == 101 and encoded[-1] == 102 and len(encoded) == 17
    assert tokenizer.decode(encoded, skip_special_tokens=True) == text
    assert len(build_char_tokenizer()) == 101  # grpo_tiny's vocabulary (and cache key) as before


def test_a_calculator_demonstration_is_the_episode_the_driver_writes():
    tokenizer = build_tokenizer(ModelConfig(name="t", tokenizer="char_tools"))
    chat = ChatFormat(tokenizer)
    ids, labels = calculator_demonstration(chat, 37, 48)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == (
        '<bos>37+48=<tool_call>{"name":"calc","arguments":{"expr":"37+48"}}</tool_call>'
        "\nuser:\n<tool_response>\n85\n</tool_response>\nassistant: 58<eos>"
    )
    row = {"prompt": "37+48=", "answer": "58", "a": 37, "b": 48}
    with ToolSandbox(num_workers=1) as tools:
        runtime = EnvRuntime(tools)
        start, trajectory = replay(CalculatorEnv, runtime, chat, ids, labels, row, "</tool_call>")
    assert trajectory.prompt_ids + trajectory.response_ids == ids
    assert trajectory.loss_mask == [int(label != -100) for label in labels[start:]]
    assert (trajectory.reward, trajectory.num_tool_calls) == (1.0, 1)


@pytest.mark.parametrize("apply_chat_template", [True, False])
def test_a_guess_demonstration_is_the_episode_the_driver_writes(apply_chat_template):
    tokenizer = build_char_tokenizer()
    chat = ChatFormat(tokenizer)
    data = dataclasses.replace(GUESS, apply_chat_template=apply_chat_template)
    cfg = GuessWarmStartConfig(follow_prob=0.5)
    rng = random.Random(4)
    ids, labels = guess_demonstration(chat, data, 13, cfg, rng)
    assert len(model_turns(ids, labels)) > 1  # several guesses, replies between them
    row = {"prompt": "guess 1-20:", "answer": "13", "secret": 13}
    start, trajectory = replay(
        GuessNumberEnv, EnvRuntime(), chat, ids, labels, row, max_turns=cfg.max_turns
    )
    assert trajectory.prompt_ids + trajectory.response_ids == ids
    assert trajectory.loss_mask == [int(label != -100) for label in labels[start:]]
    found = tokenizer.decode(model_turns(ids, labels)[-1], skip_special_tokens=True) == "13"
    assert trajectory.end_reason == ("done" if found else "max_turns")


def test_the_sloppy_guesser_heeds_the_replies_only_sometimes():
    chat = ChatFormat(build_char_tokenizer())
    rng = random.Random(0)

    def heeded(follow_prob: float) -> float:
        """Share of guesses after the first that fall inside the interval left by the replies."""
        inside = total = 0
        for _ in range(200):
            secret = rng.randint(1, 20)
            cfg = GuessWarmStartConfig(follow_prob=follow_prob)
            ids, labels = guess_demonstration(chat, GUESS, secret, cfg, rng)
            guesses = [
                int(chat.tokenizer.decode(t, skip_special_tokens=True))
                for t in model_turns(ids, labels)
            ]
            low, high = 1, 20
            for previous, guess in zip(guesses, guesses[1:], strict=False):
                low, high = (
                    (max(low, previous + 1), high)
                    if previous < secret
                    else (low, min(high, previous - 1))
                )
                inside += low <= guess <= high
                total += 1
        return inside / total

    assert heeded(1.0) == 1.0 and 0.5 < heeded(0.5) < 0.95


def test_the_agent_recipes_train_cache_and_key_like_grpo_tiny(tmp_path):
    model = ModelConfig(name="t", tokenizer="char_tools", arch=ARCH)
    tiny_tool = ToolWarmStartConfig(steps=3, batch_size=8, warmup_steps=1, max_attempts=2)
    folder = calculator_warm_start(model, ADDITION, tmp_path, tiny_tool)
    metadata = json.loads((folder / "warmstart.json").read_text())
    assert metadata["inputs"]["arch"] == ARCH and metadata["inputs"]["digits"] == 1
    # 3 steps copy nothing: the next seed was tried, the better of the two kept.
    assert metadata["attempts"] == 2 and metadata["seed"] in (0, 1)
    assert 0 <= metadata["tool_path"] < tiny_tool.min_tool_path
    grown = warm_started_model_config(model, folder)
    tokenizer = build_tokenizer(grown)
    assert len(tokenizer) == 105 and tokenizer.chat_template == build_char_tokenizer().chat_template
    assert build_causal_lm(grown, tokenizer).get_input_embeddings().weight.shape[0] == 105
    assert calculator_warm_start(model, ADDITION, tmp_path, tiny_tool) == folder
    other = dataclasses.replace(tiny_tool, tool_share=0.9)
    assert calculator_warm_start(model, ADDITION, tmp_path, other) != folder
    two_digits = dataclasses.replace(ADDITION, digits=2)
    assert calculator_warm_start(model, two_digits, tmp_path, tiny_tool) != folder
    with pytest.raises(ValueError, match="data.kind=synthetic_addition"):
        calculator_warm_start(model, GUESS, tmp_path, tiny_tool)

    tiny_guess = GuessWarmStartConfig(steps=3, batch_size=8, warmup_steps=1)
    guess = guess_warm_start(
        ModelConfig(name="t", tokenizer="char", arch=ARCH), GUESS, tmp_path, tiny_guess
    )
    assert guess.name.startswith("guess-warmstart-") and (guess / "warmstart.json").is_file()
    wider = dataclasses.replace(GUESS, guess_range=[1, 50])
    assert (
        guess_warm_start(
            ModelConfig(name="t", tokenizer="char", arch=ARCH), wider, tmp_path, tiny_guess
        )
        != guess
    )


def test_each_run_gets_the_recipe_of_its_environment_and_task():
    text = ModelConfig(name="t")
    assert policy_task(text, ADDITION, "calculator").warm_start is calculator_warm_start
    assert policy_task(text, GUESS, "guess_number").warm_start is guess_warm_start
    assert policy_task(text, ADDITION, None).warm_start is warm_start
    assert policy_task(text, ADDITION, "my_lab.envs:Agent").warm_start is warm_start
