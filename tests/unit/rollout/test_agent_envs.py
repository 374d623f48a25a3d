"""The environment protocol: the resolver, the built-ins stepped by hand, the chat format."""

from __future__ import annotations

import numpy as np
import pytest

from relax_hpc.data.tasks import GuessNumberTask
from relax_hpc.models.chat_format import ChatFormat
from relax_hpc.models.tokenizer import build_char_tokenizer
from relax_hpc.rollout.envs import (
    BUILTIN_ENVIRONMENTS,
    Action,
    EnvRuntime,
    Observation,
    episode_seed,
    resolve_environment,
)
from relax_hpc.rollout.envs.brighter import BrighterEnv
from relax_hpc.rollout.envs.calculator import CalculatorEnv, calculate
from relax_hpc.rollout.envs.guess_number import GuessNumberEnv
from relax_hpc.rollout.envs.python_math import PythonMathEnv
from relax_hpc.rollout.tools.sandbox import ToolSandbox

ROW = {"prompt": "37+48=", "answer": "58", "a": 37, "b": 48}


@pytest.fixture(scope="module")
def runtime():
    with ToolSandbox(num_workers=2, timeout_s=5.0) as tools:
        yield EnvRuntime(tools=tools)


def action(text: str, turn: int = 0) -> Action:
    return Action(text, (), "stop", None, turn)


# --- the resolver ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BUILTIN_ENVIRONMENTS))
def test_every_builtin_resolves(name, runtime):
    assert callable(resolve_environment(name)(runtime).step)


def test_a_user_class_resolves_by_module_and_name():
    cls = resolve_environment("agent_fixtures:CountdownEnv")
    assert cls.__name__ == "CountdownEnv"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("calculater", r"rollout.environment: 'calculater' is not a built-in environment \("
         r"brighter, calculator, guess_number, python_math\); user environments are written as"),
        ("no_such_pkg.envs:Env", "rollout.environment: cannot import 'no_such_pkg.envs'"),
        ("agent_fixtures:Missing", "agent_fixtures has no class 'Missing'"),
        ("agent_fixtures:NoStep", "has no step method"),
        ("agent_fixtures:NeedsTwoArguments", r"cannot be built as NeedsTwoArguments\(runtime\)"),
    ],
)  # fmt: skip
def test_a_bad_environment_is_a_clear_valueerror(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_environment(spec)


def test_options_are_checked_at_resolution():
    assert resolve_environment("guess_number", {"low": 1, "high": 9})
    with pytest.raises(ValueError, match=r"GuessNumberEnv has no option \['hihg'\]"):
        resolve_environment("guess_number", {"hihg": 9})
    with pytest.raises(ValueError, match="low .5. must be below high .5."):
        resolve_environment("guess_number", {"low": 5, "high": 5})
    with pytest.raises(ValueError, match="network must be one of"):
        resolve_environment("python_math", {"network": "on"})


def test_episode_seeds_are_stable_per_sample_and_differ_between_samples():
    assert episode_seed(1, "3/0") == episode_seed(1, "3/0")
    assert len({episode_seed(1, "3/0"), episode_seed(1, "3/1"), episode_seed(2, "3/0")}) == 3


# --- calculator --------------------------------------------------------------------------------
def test_calculate_evaluates_arithmetic_and_nothing_else():
    assert calculate("37+48") == "85"
    assert calculate(" (2+3)*4 - 6//4 ") == "19"
    assert calculate("7/2") == "3.5" and calculate("-2**10") == "-1024"
    for bad in ("__import__('os')", "x+1", "2**1000", "1+", "[1]"):
        with pytest.raises(ValueError):
            calculate(bad)


@pytest.mark.parametrize(
    ("text", "status", "output"),
    [
        ('<tool_call>{"name": "calc", "arguments": {"expr": "37+48"}}</tool_call>', "ok", "85"),
        ('<tool_call>{"name": "calc", "arguments": {"expr": "1/0"}}</tool_call>', "error",
         "error: ZeroDivisionError: division by zero"),
        ('<tool_call>{"name": "calc", "arguments": {"expr": "37+48"</tool_call>', "invalid",
         "error: tool call is not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "unknown_tool",
         "error: unknown tool 'add'; available tools: calc"),
        ('<tool_call>{"name": "calc", "arguments": {"expr": "1", "x": 2}}</tool_call>', "invalid",
         "error: calc: unexpected argument ['x']"),
        ('<tool_call>{"name": "calc", "arguments": {}}</tool_call>', "invalid",
         "error: calc: missing argument ['expr']"),
        ('<tool_call>{"name": "calc", "arguments": {"expr": "3"', "invalid",
         "error: tool call has no closing </tool_call> tag"),
    ],
)  # fmt: skip
def test_calculator_tool_calls_become_tool_messages(runtime, text, status, output):
    env = CalculatorEnv(runtime)
    assert env.stop == ("</tool_call>",)
    assert env.reset(ROW, seed=0) is None
    result = env.step(action(text))
    assert not result.done and result.reward == 0.0
    assert [r.status for r in result.tool_results] == [status]
    assert result.observation.messages[0]["role"] == "tool"
    assert result.observation.messages[0]["content"].startswith(output)


def test_calculator_scores_the_final_answer_and_can_run_without_its_tool(runtime):
    env = CalculatorEnv(runtime)
    env.reset(ROW, seed=0)
    assert env.step(action(" 58 ", turn=1)).reward == 1.0
    wrong = env.step(action("85", turn=1))
    assert wrong.done and wrong.reward == 0.0 and wrong.info == {"correct": False}
    bare = CalculatorEnv(EnvRuntime(runtime.tools, {"tool_enabled": False}))
    bare.reset(ROW, seed=0)
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "37+48"}}</tool_call>'
    assert bare.step(action(call)).tool_results[0].status == "unknown_tool"


def test_more_calls_than_allowed_in_one_turn_are_not_run(runtime):
    env = CalculatorEnv(runtime)
    env.reset(ROW, seed=0)
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>'
    result = env.step(action(call * 5))
    assert [r.status for r in result.tool_results] == ["ok"] * 4 + ["invalid"]
    assert "more than 4 tool calls" in result.observation.messages[4]["content"]


# --- guess_number ------------------------------------------------------------------------------
def test_guess_number_replies_and_rewards_fast_success():
    env = GuessNumberEnv(EnvRuntime(options={"turn_penalty": 0.25}))
    env.reset({"secret": 7}, seed=0)
    replies = [env.step(action(text, turn)) for turn, text in enumerate(["10", "3", "so?"])]
    assert [r.observation.messages[0]["content"] for r in replies] == [
        "lower",
        "higher",
        "say a number",
    ]
    assert not any(r.done for r in replies)
    found = env.step(action("I say 7", 3))
    assert found.done and found.reward == pytest.approx(0.25)


def test_guess_number_secrets_come_from_the_row_or_the_episode_seed():
    task = GuessNumberTask(50, low=1, high=20, split_seed=3)
    assert task[4] == GuessNumberTask(50, 1, 20, 3)[4] and len(task) == 50
    assert {row["secret"] for row in task} <= set(range(1, 21))
    env = GuessNumberEnv(EnvRuntime())
    env.reset({"prompt": "guess 1-20:"}, seed=episode_seed(0, "a"))
    again = GuessNumberEnv(EnvRuntime())
    again.reset({"prompt": "guess 1-20:"}, seed=episode_seed(0, "a"))
    assert env.secret == again.secret


# --- python_math -------------------------------------------------------------------------------
def test_python_math_shows_the_tool_in_the_prompt_runs_code_and_scores_math(runtime):
    env = PythonMathEnv(EnvRuntime(runtime.tools, {"timeout_s": 2.0}))
    first = env.reset({"prompt": "What is 2+2?", "answer": "4", "level": 1}, seed=0)
    assert first == Observation(
        ({"role": "user", "content": "What is 2+2?"},), (env.tool_specs()[0].schema(),)
    )
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(2+2)"}}</tool_call>'
    ran = env.step(action(call))
    assert ran.observation.messages[0]["content"] == "4\n"
    sneaky = '{"code": "print(1)", "timeout_s": 999}'
    refused = env.step(
        action(f'<tool_call>{{"name": "python", "arguments": {sneaky}}}</tool_call>')
    )
    assert "unexpected argument ['timeout_s']" in refused.observation.messages[0]["content"]
    assert env.step(action("The answer is \\boxed{4}.", 1)).reward == 1.0
    assert env.step(action("The answer is \\boxed{5}.", 1)).reward == 0.0


# --- the chat format ---------------------------------------------------------------------------
CHATML = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif -%}"
    "{{ '\\n<tool_response>\\n' ~ m['content'] ~ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- else -%}{{ '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ '<|im_end|>\\n' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)  # Qwen3's layout for user and tool turns (no system or <think> handling)


def chatml_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHATML
    return tokenizer


def test_char_template_observations_mirror_qwen3_tool_responses():
    chat = ChatFormat(build_char_tokenizer())
    assert chat.turn_closing == "\n"
    tools = [{"role": "tool", "content": "85"}, {"role": "tool", "content": "7"}]
    assert chat.observation_text(tools, None) == (
        "\nuser:\n<tool_response>\n85\n</tool_response>\n<tool_response>\n7\n</tool_response>\n"
        "assistant: "
    )
    feedback = chat.observation_text([{"role": "user", "content": "higher"}], "<eos>")
    assert feedback == "\nuser: higher\nassistant: "
    ids = chat.observation_ids([{"role": "user", "content": "x"}], None)
    assert chat.tokenizer.decode(ids) == "\nuser: x\nassistant: "
    assert chat.tokenizer.bos_token_id not in ids


def test_char_template_writes_assistant_tool_calls_as_qwen3_does():
    tokenizer = build_char_tokenizer()
    call = {"type": "function", "function": {"name": "calc", "arguments": {"expr": "1+1"}}}
    messages = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "2"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        'user: 1+1=\nassistant: <tool_call>\n{"name": "calc", "arguments": {"expr": "1+1"}}\n'
        "</tool_call>\nuser:\n<tool_response>\n2\n</tool_response>\nassistant: 2\n"
    )


def test_an_end_of_turn_token_is_not_written_twice():
    chat = ChatFormat(chatml_tokenizer())
    assert chat.turn_closing == "<|im_end|>\n"
    tool = [{"role": "tool", "content": "85"}]
    body = (
        "<|im_start|>user\n<tool_response>\n85\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.observation_text(tool, "<|im_end|>") == "\n" + body
    assert chat.observation_text(tool, None) == "<|im_end|>\n" + body  # stopped at </tool_call>
    ids = chat.observation_ids(tool, None)
    assert ids[0] == chat.tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_a_tokenizer_without_chat_template_is_refused():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has none"):
        ChatFormat(tokenizer)


# --- brighter ----------------------------------------------------------------------------------
def test_brighter_shows_a_then_b_and_rewards_naming_the_brighter(runtime):
    env = BrighterEnv(runtime)
    first = env.reset({"seed": 3}, seed=99)
    (image_a,) = first.images
    observed = env.step(action("ok", turn=0))
    (image_b,) = observed.observation.images
    question = observed.observation.messages[0]["content"][-1]["text"]
    assert not observed.done and "A or B" in question
    assert abs(int(image_a[0, 0, 0]) - int(image_b[0, 0, 0])) >= 40
    right = "A" if image_a.mean() > image_b.mean() else "B"
    wrong = "B" if right == "A" else "A"
    assert env.step(action(f"it is {right}", turn=1)).reward == 1.0
    assert env.step(action(f"{wrong}.", turn=1)).reward == 0.0
    assert env.step(action("no idea", turn=1)).info == {"answered": False}
    again = BrighterEnv(runtime)
    assert np.array_equal(again.reset({"seed": 3}, seed=1).images[0], image_a)  # the row's seed
