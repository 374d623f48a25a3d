"""Environments whose model calls tools: parse the calls, run them, show the results.

A ``ToolEnvironment`` declares its tools (``ToolSpec``: the name the model calls, the
function that runs in the sandbox, a JSON schema for the prompt, and arguments bound by the
environment that the model cannot set). A turn with ``<tool_call>`` blocks is answered with
one ``tool`` message per block, in order: the tool's output, or an error the model can read
(malformed call, unknown tool, unexpected argument, too many calls, timeout, crash). A turn
without a tool call is the final answer: ``finish`` scores it and ends the episode.

By default a turn stops at the first ``</tool_call>`` (one call per turn, and the model's
turn ends right where the answer is needed); ``stop_at_tool_call = False`` lets a turn run
to its end-of-turn token with several (parallel) calls.

Must not: import torch or the engines.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

from relax_hpc.rollout.envs.base import Action, Environment, EnvRuntime, Observation, StepResult
from relax_hpc.rollout.tools.parser import CLOSE_TAG, ParsedTurn, ToolCall, parse_tool_calls
from relax_hpc.rollout.tools.sandbox import ToolResult


@dataclass(frozen=True)
class ToolSpec:
    name: str  # what the model writes in "name"
    function: str  # "package.module:function", run in the tool sandbox
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the model's arguments (an "object")
    bound: Mapping[str, Any] = field(default_factory=dict)  # set here; the model cannot

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates render (Qwen3's ``<tools>``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


def string_parameter(name: str, description: str) -> dict[str, Any]:
    """The JSON schema of a tool taking one required string argument ``name``."""
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": description}},
        "required": [name],
    }


class ToolEnvironment(Environment):
    uses_tools: ClassVar[bool] = True
    stop_at_tool_call: ClassVar[bool] = True
    max_calls_per_turn: ClassVar[int] = 4

    def __init__(self, runtime: EnvRuntime) -> None:
        super().__init__(runtime)
        if runtime.tools is None:
            raise ValueError(f"{type(self).__name__} calls tools; the runtime has no ToolSandbox")
        self.stop = (CLOSE_TAG,) if self.stop_at_tool_call else ()

    @abc.abstractmethod
    def tool_specs(self) -> Sequence[ToolSpec]:
        """The tools this episode offers (may depend on ``self.options``)."""

    @abc.abstractmethod
    def finish(self, action: Action) -> StepResult:
        """Score a turn without tool calls (the final answer); normally ``done=True``."""

    def step(self, action: Action) -> StepResult:
        parsed = parse_tool_calls(action.text)
        if not parsed.has_tool_calls:
            return self.finish(action)
        results = self.run_calls(parsed)
        messages = tuple({"role": "tool", "content": r.output} for r in results)
        return StepResult(Observation(messages), tool_results=tuple(results))

    def run_calls(self, parsed: ParsedTurn) -> list[ToolResult]:
        """One result per block, in order; valid calls run concurrently in the sandbox."""
        tools = {spec.name: spec for spec in self.tool_specs()}
        assert self.runtime.tools is not None
        pending: list[Future[ToolResult] | ToolResult] = []
        for index, block in enumerate(parsed.blocks):
            if index >= self.max_calls_per_turn:
                reason = f"more than {self.max_calls_per_turn} tool calls in one turn"
                pending.append(
                    ToolResult("invalid", f"error: {reason}; this one was not run", reason)
                )
            elif not isinstance(block, ToolCall):
                pending.append(ToolResult("invalid", f"error: {block.message}", block.message))
            elif (problem := _call_problem(block, tools)) is not None:
                pending.append(problem)
            else:
                spec = tools[block.name]
                arguments = {**block.arguments, **spec.bound}
                pending.append(self.runtime.tools.submit(spec.function, arguments))
        return [p.result() if isinstance(p, Future) else p for p in pending]


def _call_problem(call: ToolCall, tools: Mapping[str, ToolSpec]) -> ToolResult | None:
    """An error result for a call that must not run, or None."""
    if call.name not in tools:
        available = ", ".join(sorted(tools)) or "none"
        reason = f"unknown tool {call.name!r}"
        return ToolResult("unknown_tool", f"error: {reason}; available tools: {available}", reason)
    spec = tools[call.name]
    allowed = set(spec.parameters.get("properties", {}))
    unexpected = sorted(set(call.arguments) - allowed)
    missing = sorted(set(spec.parameters.get("required", [])) - set(call.arguments))
    if unexpected or missing:
        parts = [f"unexpected argument {unexpected}"] * bool(unexpected)
        parts += [f"missing argument {missing}"] * bool(missing)
        reason = f"{call.name}: {'; '.join(parts)}"
        return ToolResult("invalid", f"error: {reason}", reason)
    return None
