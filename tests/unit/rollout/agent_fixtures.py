"""Tools and environments for the agent tests, in a module that imports nothing heavy.

Tool workers import this module by name (its folder is on ``sys.path`` under pytest, and
the sandbox hands the caller's ``sys.path`` to its workers), so it must stay cheap to import.
The "scripted" environments decide their tool calls themselves instead of parsing the model's
text: a randomly initialised tiny model writes no valid calls, and these tests are about the
driver, the sandbox and the masks, which are all real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.rollout.envs.base import Action, Environment, Observation, StepResult
from relax_hpc.rollout.envs.tool_env import ToolEnvironment, ToolSpec
from relax_hpc.rollout.tools.parser import ParsedTurn, ToolCall


# --- tools -------------------------------------------------------------------------------------
def echo(text: str) -> str:
    return text


def as_json() -> dict:
    return {"a": [1, 2]}


def hang() -> str:
    time.sleep(600)
    return "never"


def hang_with_child(pid_file: str) -> str:
    child = subprocess.Popen(["sleep", "600"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(600)
    return "never"


def hang_writing_pid(pid_file: str) -> str:
    Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)
    return "never"


def allocate(megabytes: int) -> str:
    return str(len(bytearray(megabytes * 2**20)))


def exit_hard() -> str:
    os._exit(3)


def segfault() -> str:
    os.kill(os.getpid(), signal.SIGSEGV)
    return "never"


def flood() -> str:
    return "x" * 5_000_000


def print_forever() -> str:
    while True:
        print("spam " * 100, flush=True)


def raising() -> str:
    raise RuntimeError("backend unavailable")


def sleep_then_echo(seconds: float, text: str) -> str:
    time.sleep(seconds)
    return text


# --- environments ------------------------------------------------------------------------------
ECHO_TOOL = ToolSpec(
    "echo",
    "agent_fixtures:sleep_then_echo",
    "echo a text after a delay",
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
)


class ScriptedToolEnv(ToolEnvironment):
    """Calls ``echo`` (delay ``row["delay"]`` s) on each of the first ``row["calls"]`` turns,
    then ends with reward 1 on the next turn."""

    @dataclass(frozen=True)
    class Options:
        delay_s: float = 0.0

    def tool_specs(self) -> Sequence[ToolSpec]:
        return (ECHO_TOOL,)

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        self.calls_left = int(row["calls"])
        self.delay = float(row.get("delay", self.options.delay_s))
        return None

    def step(self, action: Action) -> StepResult:
        if self.calls_left == 0:
            return self.finish(action)
        self.calls_left -= 1
        call = ToolCall("echo", {"text": f"echo {action.turn}", "seconds": self.delay})
        results = self.run_calls(ParsedTurn([call]))
        messages = tuple({"role": "tool", "content": r.output} for r in results)
        return StepResult(Observation(messages), tool_results=tuple(results))

    def run_calls(self, parsed: ParsedTurn):
        # "seconds" is the fixture's own argument, not the model's: bypass the schema check.
        assert self.runtime.tools is not None
        return [self.runtime.tools.run(ECHO_TOOL.function, c.arguments) for c in parsed.calls]

    def finish(self, action: Action) -> StepResult:
        return StepResult(reward=1.0, done=True, info={"last_turn": action.turn})


class CountdownEnv(Environment):
    """A user environment: replies "again" until ``row["turns"]`` turns, then reward 1."""

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        self.turns_left = int(row["turns"])
        self.seed = seed
        return None

    def step(self, action: Action) -> StepResult:
        self.turns_left -= 1
        if self.turns_left <= 0:
            return StepResult(reward=1.0, done=True, info={"seed": self.seed})
        return StepResult(Observation(({"role": "user", "content": "again"},)))


class RaisingEnv(CountdownEnv):
    """Raises in ``step`` on rows with ``boom``; a countdown otherwise."""

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        self.boom = bool(row.get("boom"))
        return super().reset(row, seed)

    def step(self, action: Action) -> StepResult:
        if self.boom:
            raise RuntimeError("environment bug")
        return super().step(action)


class SlowStepEnv(CountdownEnv):
    def step(self, action: Action) -> StepResult:
        time.sleep(5.0)
        return super().step(action)


class NoStep:
    def __init__(self, runtime) -> None:
        pass

    def reset(self, row, seed):
        return None


class NeedsTwoArguments(CountdownEnv):
    def __init__(self, runtime, other) -> None:
        super().__init__(runtime)
