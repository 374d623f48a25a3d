"""A user's environment with misbehaving tools, run as ``agent_user_env:FaultyToolsEnv``.

Imported by name by the rollout (``rollout.environment``) and by its tool workers (the
sandbox hands them the rollout's ``sys.path``), so it stays cheap to import. Most of its
tools are the misbehaving ones of ``tests/unit/rollout/agent_fixtures.py`` (the e2e test
puts both folders on ``PYTHONPATH``). The e2e runs
start from a randomly initialised model, which writes no valid tool call: the environment
makes the episode's call itself (everything it goes through - the driver, the sandbox and
its limits, the masks, the spool - is real). Each episode, from its seed:

- turn 0: calls one tool, ``ok`` (answers after ``ok_delay_s``), ``hang`` (sleeps for ten
  minutes), ``spam`` (prints forever), ``crash`` (the worker exits), ``segfault``,
  ``flood`` (answers 5 MB), ``raise`` (an exception), or the environment itself raises
  (``env_bug``); the tool's answer or error is the observation;
- turn 1: ends the episode, reward 1 if the tool answered, 0.5 for a model turn that wrote
  a digit, else 0 (rewards differ within a group: the advantages are not all zero).

With ``marker_dir`` set, every step first touches ``<marker_dir>/step``: the e2e test
knows a step (a tool call) is in flight.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.rollout.envs import Action, Observation, StepResult
from relax_hpc.rollout.envs.tool_env import ToolEnvironment, ToolSpec
from relax_hpc.rollout.tools.parser import ParsedTurn, ToolCall

FAULTS = ("ok", "hang", "spam", "crash", "segfault", "flood", "raise", "env_bug")


def ok(delay_s: float) -> str:
    time.sleep(delay_s)
    return "42"


def hang() -> str:
    time.sleep(600)
    return "never"


def _spec(name: str, function: str, bound: Mapping[str, Any] | None = None) -> ToolSpec:
    """``function``: ``module:name``, or a name in this module."""
    target = function if ":" in function else f"agent_user_env:{function}"
    schema = {"type": "object", "properties": {}}
    return ToolSpec(name, target, name, schema, dict(bound or {}))


class FaultyToolsEnv(ToolEnvironment):
    @dataclass(frozen=True)
    class Options:
        ok_delay_s: float = 0.2
        marker_dir: str = ""

    def tool_specs(self) -> Sequence[ToolSpec]:
        return (
            _spec("ok", "ok", {"delay_s": self.options.ok_delay_s}),
            _spec("hang", "hang"),
            # The misbehaving tools of the tool-sandbox unit tests.
            _spec("spam", "agent_fixtures:print_forever"),
            _spec("crash", "agent_fixtures:exit_hard"),
            _spec("segfault", "agent_fixtures:segfault"),
            _spec("flood", "agent_fixtures:flood"),
            _spec("raise", "agent_fixtures:raising"),
        )

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        self.fault = random.Random(seed).choice(FAULTS)
        return None

    def step(self, action: Action) -> StepResult:
        if self.options.marker_dir:
            (Path(self.options.marker_dir) / "step").touch()
        if action.turn > 0:
            return self.finish(action)
        if self.fault == "env_bug":
            raise RuntimeError("a bug in the user's environment")
        results = self.run_calls(ParsedTurn([ToolCall(self.fault, {})]))
        self.answered = results[0].ok
        messages = tuple({"role": "tool", "content": r.output} for r in results)
        return StepResult(Observation(messages), tool_results=tuple(results))

    def finish(self, action: Action) -> StepResult:
        wrote_digit = any(c.isdigit() for c in action.text)
        reward = 1.0 if self.answered else 0.5 if wrote_digit else 0.0
        return StepResult(reward=reward, done=True, info={"fault": self.fault})
