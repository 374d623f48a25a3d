"""Qwen3-format tool calls: valid, malformed, unclosed; bad text is an error, never a raise."""

from __future__ import annotations

import pytest

from relax_hpc.rollout.tools.parser import ToolCall, ToolCallError, parse_tool_calls


def test_a_call_in_qwen3_layout_and_a_compact_one():
    qwen = '<tool_call>\n{"name": "calc", "arguments": {"expr": "37+48"}}\n</tool_call>'
    compact = '<tool_call>{"name":"calc","arguments":{"expr":"1+2"}}</tool_call>'
    assert parse_tool_calls(qwen).blocks == [ToolCall("calc", {"expr": "37+48"})]
    assert parse_tool_calls(compact).calls == [ToolCall("calc", {"expr": "1+2"})]


def test_several_calls_keep_their_order_and_the_text_outside():
    text = (
        'Let me check. <tool_call>{"name": "a", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call> done'
    )
    parsed = parse_tool_calls(text)
    assert parsed.blocks == [ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert parsed.content == "Let me check.  and  done"
    assert parsed.has_tool_calls


def test_text_without_calls_is_a_final_answer():
    parsed = parse_tool_calls("58")
    assert not parsed.has_tool_calls and parsed.blocks == [] and parsed.content == "58"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "calc", "arguments": {"expr": "1+2"}', "not valid JSON"),
        ("calc(1+2)", "not valid JSON"),
        ('["calc"]', "JSON object"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "calc", "arguments": [1]}', '"arguments" must be a JSON object'),
        ('{"name": "calc", "arguments": "not json"}', "arguments string is not JSON"),
    ],
)
def test_malformed_calls_become_errors_for_the_model(body, message):
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == [] and len(parsed.errors) == 1
    assert message in parsed.errors[0].message
    assert parsed.errors[0].text == body


def test_a_call_without_closing_tag_is_an_error_after_the_good_ones():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "argu'
    parsed = parse_tool_calls(text)
    assert parsed.blocks[0] == ToolCall("a", {})
    assert isinstance(parsed.blocks[1], ToolCallError)
    assert "no closing </tool_call>" in parsed.blocks[1].message
