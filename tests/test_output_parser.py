"""Reasoning and tool calls are split out of streamed text, whatever the chunking."""

from __future__ import annotations

import json

import pytest

from proxy.output import OutputParser, merge

TEXT = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def _parse(text: str, step: int, **kw):
    p = OutputParser(**kw)
    parts = []
    for i in range(0, len(text), step):
        parts += p.feed(text[i : i + step])
    parts += p.finish()
    return merge(parts)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_text_and_tool_calls_split_at_any_chunking(step):
    parts = _parse(TEXT, step)
    assert [p.kind for p in parts] == ["reasoning", "text", "tool_call", "tool_call"]
    assert parts[0].text == "\nThe user wants the weather.\n"
    assert parts[1].text == "Let me check."
    assert (parts[2].call.name, parts[2].call.arguments) == ("get_weather", {"city": "Paris"})
    assert (parts[3].call.name, parts[3].call.arguments) == ("get_time", {"tz": "CET"})
    assert parts[2].call.id != parts[3].call.id


def test_prompt_that_opened_think_starts_in_reasoning():
    parts = _parse("planning</think>answer", 2, in_reasoning=True)
    assert [(p.kind, p.text) for p in parts] == [("reasoning", "planning"), ("text", "answer")]


def test_malformed_tool_call_is_kept_as_text():
    parts = _parse("<tool_call>{not json}</tool_call>", 3)
    assert [(p.kind, p.text) for p in parts] == [("text", "<tool_call>{not json}</tool_call>")]


def test_unterminated_tool_call_is_text_at_finish():
    parts = _parse('<tool_call>{"name": "x"', 4)
    assert parts[0].kind == "text" and parts[0].text.startswith("<tool_call>")


def test_tools_not_parsed_when_request_had_no_tools():
    parts = _parse('<tool_call>{"name": "x", "arguments": {}}</tool_call>', 5, parse_tools=False)
    assert [p.kind for p in parts] == ["text"]


def test_partial_tag_is_held_back_until_resolved():
    p = OutputParser()
    assert [x.text for x in p.feed("hello <th")] == ["hello "]
    assert [x.text for x in p.feed("ere")] == ["<there"]


def test_openai_and_anthropic_sdk_models_accept_tool_call_responses():
    """The response builders' shapes validate against the SDKs' own types."""
    from anthropic.types import Message
    from openai.types.chat import ChatCompletion

    from proxy.anthropic_api import block_json
    from proxy.openai_api import tool_call_json

    parts = _parse(TEXT, 5)
    call = tool_call_json(parts[2])
    cc = ChatCompletion.model_validate(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                }
            ],
        }
    )
    assert json.loads(cc.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    msg = Message.model_validate(
        {
            "id": "msg",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [block_json(p) for p in parts],
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    )
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg.content[2].input == {"city": "Paris"}
