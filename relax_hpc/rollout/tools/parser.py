"""Tool calls in Qwen3's format, parsed out of one assistant turn; never raises on bad text.

Qwen3's chat template asks the model to write each call as a JSON object between tags::

    <tool_call>
    {"name": "calc", "arguments": {"expr": "37+48"}}
    </tool_call>

(whitespace around the JSON is optional; ``arguments`` may also be a JSON-encoded string, as
the template accepts). Every ``<tool_call>`` block of the turn becomes a ``ToolCall`` or, when
it is malformed (not JSON, no ``name``, ``arguments`` not an object, no closing tag), a
``ToolCallError`` whose message is written for the model: the driver hands it back as the
tool's response, so a bad call is an observation, not a crash.

Must not: run tools or know which tools exist (unknown names are the environment's call).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A ``<tool_call>`` block that could not be read; ``message`` is shown to the model."""

    message: str
    text: str  # the block as written (without tags), for logs


@dataclass(frozen=True)
class ParsedTurn:
    """The ``<tool_call>`` blocks of one turn in order; ``content``: the text outside them."""

    blocks: list[ToolCall | ToolCallError] = field(default_factory=list)
    content: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return [b for b in self.blocks if isinstance(b, ToolCall)]

    @property
    def errors(self) -> list[ToolCallError]:
        return [b for b in self.blocks if isinstance(b, ToolCallError)]

    @property
    def has_tool_calls(self) -> bool:
        """True when the turn tried to call a tool (well-formed or not)."""
        return bool(self.blocks)


def parse_tool_calls(text: str) -> ParsedTurn:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order."""
    blocks: list[ToolCall | ToolCallError] = []
    outside: list[str] = []
    position = 0
    while (start := text.find(OPEN_TAG, position)) != -1:
        outside.append(text[position:start])
        body_start = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body_start)
        if end == -1:
            body = text[body_start:]
            blocks.append(ToolCallError(f"tool call has no closing {CLOSE_TAG} tag", body))
            position = len(text)
            break
        blocks.append(parse_call_body(text[body_start:end]))
        position = end + len(CLOSE_TAG)
    outside.append(text[position:])
    return ParsedTurn(blocks, "".join(outside).strip())


def parse_call_body(body: str) -> ToolCall | ToolCallError:
    """One block's JSON ``{"name": str, "arguments": object}``."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCallError(f"tool call is not valid JSON ({error.msg} at char {error.pos})", body)
    if not isinstance(payload, dict):
        return ToolCallError("tool call must be a JSON object with name and arguments", body)
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('tool call has no "name" string', body)
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # the template also accepts arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCallError(f'tool call "{name}": arguments string is not JSON', body)
    if not isinstance(arguments, dict):
        return ToolCallError(f'tool call "{name}": "arguments" must be a JSON object', body)
    return ToolCall(name, arguments)
