"""The official anthropic SDK drives the real server, shaped like Claude Code's requests."""

from __future__ import annotations

import httpx

SYSTEM_BLOCKS = [
    {
        "type": "text",
        "text": "x-anthropic-billing-header: cc_version=1.0.0.abc; cc_entrypoint=cli;",
    },
    {
        "type": "text",
        "text": "You are an agent for software engineering tasks.",
        "cache_control": {"type": "ephemeral"},
    },
]
TOOLS = [
    {
        "name": "Read",
        "description": "Read a file from the local filesystem.",
        "input_schema": {
            "type": "object",
            "properties": {"file_path": {"type": "string"}},
            "required": ["file_path"],
        },
    },
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    },
]
HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "Show me the README."}]},
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I should read the file.", "signature": "sig"},
            {"type": "text", "text": "Reading it."},
            {
                "type": "tool_use",
                "id": "toolu_01",
                "name": "Read",
                "input": {"file_path": "README.md"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "# Project\nHello."},
            {"type": "text", "text": "Summarize it.", "cache_control": {"type": "ephemeral"}},
        ],
    },
]


def test_messages_create_with_claude_code_shaped_request(anthropic_client):
    msg = anthropic_client.messages.create(
        model="demo-llama",
        max_tokens=16,
        system=SYSTEM_BLOCKS,
        tools=TOOLS,
        messages=HISTORY,
        extra_body={"temperature": 0},
        metadata={"user_id": "user_abc_account_x_session_y"},
        extra_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
    )
    assert msg.type == "message"
    assert msg.role == "assistant"
    assert msg.stop_reason in ("end_turn", "max_tokens", "tool_use")
    u = msg.usage
    assert u.input_tokens >= 0
    assert u.cache_read_input_tokens is not None
    assert u.cache_creation_input_tokens is not None
    assert u.output_tokens >= 1


def test_messages_stream_event_sequence_and_final_message(anthropic_client):
    with anthropic_client.messages.stream(
        model="demo-hybrid",
        max_tokens=16,
        system=SYSTEM_BLOCKS,
        tools=TOOLS,
        messages=HISTORY,
        extra_body={"temperature": 0},
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start"
    assert events[-1] == "message_stop"
    assert "message_delta" in events
    assert events.count("content_block_start") == events.count("content_block_stop")
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert final.usage.output_tokens >= 1
    create = anthropic_client.messages.create(
        model="demo-hybrid",
        max_tokens=16,
        system=SYSTEM_BLOCKS,
        tools=TOOLS,
        messages=HISTORY,
        extra_body={"temperature": 0},
    )
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in create.content]


def test_count_tokens_matches_usage(anthropic_client):
    counted = anthropic_client.messages.count_tokens(
        model="demo-llama", system=SYSTEM_BLOCKS, tools=TOOLS, messages=HISTORY
    )
    msg = anthropic_client.messages.create(
        model="demo-llama", max_tokens=1, system=SYSTEM_BLOCKS, tools=TOOLS, messages=HISTORY
    )
    u = msg.usage
    total = u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    # The generation prompt adds the assistant header on top of the counted messages.
    assert 0 <= total - counted.input_tokens <= 8


def test_stop_sequences_reported(anthropic_client, server):
    base = anthropic_client.messages.create(
        model="demo-llama",
        max_tokens=20,
        messages=[{"role": "user", "content": "Go on"}],
        extra_body={"temperature": 0},
    )
    text = "".join(b.text for b in base.content if b.type == "text")
    if len(text) < 6:
        return
    stop = text[3:6]
    msg = anthropic_client.messages.create(
        model="demo-llama",
        max_tokens=20,
        messages=[{"role": "user", "content": "Go on"}],
        extra_body={"temperature": 0},
        stop_sequences=[stop],
    )
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == stop


def test_messages_error_shape_is_anthropic(server):
    r = httpx.post(
        server.url + "/v1/messages", json={"model": "demo-llama", "messages": []}, timeout=30
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"


def test_system_message_inside_conversation_joins_the_user_turn(anthropic_client):
    """Claude Code 2.x sends {"role": "system"} after the user turn (agent listings)."""
    base = [{"role": "user", "content": [{"type": "text", "text": "say hello"}]}]
    with_system = base + [{"role": "system", "content": "Available agent types: claude."}]
    plain = anthropic_client.messages.count_tokens(model="demo-llama", messages=base)
    joined = anthropic_client.messages.count_tokens(model="demo-llama", messages=with_system)
    assert joined.input_tokens > plain.input_tokens
    msg = anthropic_client.messages.create(
        model="demo-llama",
        max_tokens=4,
        messages=with_system,
        extra_body={"thinking": {"type": "adaptive"}, "context_management": {"edits": []}},
    )
    assert msg.usage.output_tokens == 4
