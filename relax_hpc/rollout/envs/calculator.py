"""``calculator``: the synthetic addition task with a calculator tool.

The prompt is the task's (``"37+48="``); the model may call ``calc`` before it answers::

    37+48=<tool_call>{"name": "calc", "arguments": {"expr": "37+48"}}</tool_call>
    user:
    <tool_response>
    85
    </tool_response>
    assistant: 58<eos>

(shown with the char tokenizer's chat template). The tool answers in the usual digit order;
the task wants the sum least-significant digit first, so the model still has to turn ``85``
into ``58``. A turn without a tool call is the final answer, scored 1 if it equals the row's
``answer`` (whitespace stripped), else 0. ``Options(tool_enabled=False)`` offers no tool
(calls are answered "unknown tool"): the same episode shape, for a run without the tool.

Must not: import torch or the engines.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.rollout.envs.base import Action, Observation, StepResult
from relax_hpc.rollout.envs.tool_env import ToolEnvironment, ToolSpec, string_parameter

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}

CALC_TOOL = ToolSpec(
    name="calc",
    function="relax_hpc.rollout.envs.calculator:calculate",
    description="Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    parameters=string_parameter("expr", "e.g. 37+48"),
)


def calculate(expr: str) -> str:
    """The value of an arithmetic expression of numbers; ValueError for anything else."""
    if not isinstance(expr, str) or len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expr must be a string of at most {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported in a calculator expression: {ast.unparse(node)!r}")


class CalculatorEnv(ToolEnvironment):
    @dataclass(frozen=True)
    class Options:
        tool_enabled: bool = True

    def tool_specs(self) -> Sequence[ToolSpec]:
        return (CALC_TOOL,) if self.options.tool_enabled else ()

    def reset(self, row: Mapping[str, Any], seed: int) -> Observation | None:
        self.answer = str(row["answer"]).strip()
        return None  # the task's own prompt

    def finish(self, action: Action) -> StepResult:
        correct = action.text.strip() == self.answer
        return StepResult(reward=float(correct), done=True, info={"correct": correct})
