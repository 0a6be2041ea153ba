"""What Codex CLI sends to /v1/responses, from a captured 0.171 request (trimmed): the body
is accepted, tools are flattened, and a turn's reasoning and calls round-trip through the
re-sent history so the next turn hits the cache past them."""

from __future__ import annotations

import copy
import json
import logging

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from engine_bridge.types import Message, ToolCall, ToolChoice
from proxy.dialects.responses import STORE, ResponseStore, build
from proxy.dialects.responses_items import arrange, parse_items, parse_tool_choice, parse_tools
from proxy.errors import ApiError
from proxy.state import SETTINGS, ProxySettings
from tests.conftest import fresh_cache_dir, start_server

SESSION = "01a235bd-5699-7652-92f1-e8952a21a3e9"
HEADERS = {"session-id": SESSION, "thread-id": SESSION, "originator": "codex_exec"}


def _fn(name: str, prop: str, description: str = "") -> dict:
    params = {"type": "object", "properties": {prop: {"type": "string"}}, "required": [prop]}
    return {"type": "function", "name": name, "description": description, "strict": False, "parameters": params}  # fmt: skip


def _msg(role: str, *texts: str) -> dict:
    content = [{"type": "input_text", "text": t} for t in texts]
    return {"type": "message", "id": f"msg_{role}", "role": role, "content": content}


# request-2 of a `codex exec` run, trimmed: texts cut short, two tools of each kind kept.
CODEX_BODY = {
    "model": "demo-hybrid",
    "stream": True,
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"},
    "store": False,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": SESSION,
    "client_metadata": {"thread_id": SESSION, "turn_id": "01a235bd-56ef"},
    "input": [
        _msg("developer", "You are a coding agent running in the Codex CLI, a terminal-based coding assistant."),
        _msg("developer", "<skills_instructions>\n## Skills\n</skills_instructions>", "<permissions instructions>\nsandbox_mode is danger-full-access\n</permissions instructions>"),
        _msg("user", "<environment_context>\n  <cwd>/tmp/cx/work</cwd>\n  <shell>bash</shell>\n</environment_context>"),
        _msg("user", "Create a file named marker.txt containing hi"),
        {"type": "function_call", "status": "completed", "id": "fc_1", "name": "exec_command", "arguments": '{"cmd": "echo hi > marker.txt"}', "call_id": "call_1"},
        {"type": "function_call_output", "id": "fco_1", "call_id": "call_1", "output": "Chunk ID: d17337\nProcess exited with code 0\nOutput:\n"},
    ],
    "tools": [
        _fn("exec_command", "cmd", "Runs a command in a PTY"),
        _fn("view_image", "path", "View a local image file"),
        {
            "type": "namespace",
            "name": "multi_agent_v1",
            "description": "Tools for spawning and managing sub-agents.",
            "tools": [_fn("spawn_agent", "task", "Spawn a sub-agent"), _fn("wait_agent", "targets")],
        },
        {"type": "web_search", "external_web_access": True},
    ],
}  # fmt: skip


def test_codex_body_is_accepted_and_streams_to_completion(server):
    with httpx.stream(
        "POST", server.url + "/v1/responses", json=CODEX_BODY | {"max_output_tokens": 8},
        headers=HEADERS, timeout=120,
    ) as r:  # fmt: skip
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]  # every event names itself twice
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    final = data[-1]["response"]
    assert final["store"] is False and final["usage"]["output_tokens"] == 8
    # demo-hybrid opens <think> in its generation prompt: the answer starts as reasoning.
    assert final["output"][0]["type"] == "reasoning"


def _request(headers: dict | None = None) -> web.Request:
    app = web.Application()
    app[SETTINGS] = ProxySettings()
    app[STORE] = ResponseStore()
    return make_mocked_request("POST", "/v1/responses", headers=headers, app=app)


def test_codex_body_becomes_one_system_message_flat_tools_and_the_session():
    plan = build(_request(HEADERS), copy.deepcopy(CODEX_BODY))
    req = plan.req
    system = req.messages[0]
    assert system.role == "system"
    assert system.content.startswith("You are a coding agent") and "sandbox_mode" in system.content
    assert [m.role for m in req.messages] == ["system", "user", "user", "assistant", "tool"]
    assert req.messages[3].tool_calls == (
        ToolCall("exec_command", {"cmd": "echo hi > marker.txt"}, "call_1"),
    )
    assert req.messages[4] == Message("tool", CODEX_BODY["input"][5]["output"], tool_call_id="call_1")  # fmt: skip
    names = [t["function"]["name"] for t in req.tools]
    assert names == ["exec_command", "view_image", "spawn_agent", "wait_agent"]
    assert req.tool_choice == ToolChoice("auto", parallel=True)
    assert req.session == SESSION
    assert "enable_thinking" not in req.template_kwargs  # no effort sent
    assert plan.store is False


def test_hosted_tools_are_left_out_with_one_log_line(caplog):
    body = {"tools": [{"type": "web_search"}, {"type": "image_generation"}, _fn("a", "x")]}
    with caplog.at_level(logging.INFO, logger="proxy.dialects.responses_items"):
        tools = parse_tools(body)
    assert [t["function"]["name"] for t in tools.template] == ["a"]
    lines = [r.getMessage() for r in caplog.records if r.name == "proxy.dialects.responses_items"]
    assert lines == ["tools left out (hosted, not run here): web_search, image_generation"]


def test_a_nested_name_that_is_taken_gets_its_namespace_and_maps_back():
    body = {"tools": [_fn("wait", "x"), {"type": "namespace", "name": "ns", "tools": [_fn("wait", "y"), _fn("go", "z")]}]}  # fmt: skip
    tools = parse_tools(body)
    assert [t["function"]["name"] for t in tools.template] == ["wait", "ns__wait", "go"]
    assert tools.origin == {"wait": (None, "wait"), "ns__wait": ("ns", "wait"), "go": ("ns", "go")}
    assert tools.call_name("wait", "ns") == "ns__wait" and tools.call_name("go", None) == "go"
    history = [{"type": "function_call", "call_id": "c", "name": "wait", "namespace": "ns", "arguments": "{}"}]  # fmt: skip
    [m] = parse_items(history, tools, lambda i: f"input[{i}]")
    assert m.tool_calls == (ToolCall("ns__wait", {}, "c"),)
    choice = parse_tool_choice({"tool_choice": {"type": "function", "name": "wait", "namespace": "ns"}, "parallel_tool_calls": False}, tools)  # fmt: skip
    assert choice == ToolChoice("required", "ns__wait", parallel=False)


@pytest.mark.parametrize(
    "choice,want",
    [("auto", ToolChoice("auto")), ("none", ToolChoice("none")), ("required", ToolChoice("required"))],
)  # fmt: skip
def test_tool_choice_strings_map_to_the_engine_switch(choice, want):
    assert (
        parse_tool_choice({"tool_choice": choice}, parse_tools({"tools": [_fn("a", "x")]})) == want
    )


def test_required_without_function_tools_is_a_400():
    with pytest.raises(ApiError) as e:
        parse_tool_choice({"tool_choice": "required"}, parse_tools({"tools": [{"type": "web_search"}]}))  # fmt: skip
    assert e.value.param == "tool_choice"


def test_reasoning_joins_the_next_assistant_turn_with_its_text_and_calls():
    items = [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [], "encrypted_content": "opaque"},  # no text: dropped
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}], "content": None},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "a", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "a", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "raw"}], "summary": [{"type": "summary_text", "text": "short"}]},
        {"type": "function_call", "call_id": "c3", "name": "a"},
    ]  # fmt: skip
    out = parse_items(items, parse_tools({}), lambda i: f"input[{i}]")
    assert out == [
        Message("user", "go"),
        Message(
            "assistant",
            "ok",
            reasoning="plan",
            tool_calls=(ToolCall("a", {"x": 1}, "c1"), ToolCall("a", "not json", "c2")),
        ),  # fmt: skip
        Message("tool", "one", tool_call_id="c1"),
        Message("tool", "two", tool_call_id="c2"),
        Message("assistant", "", reasoning="raw", tool_calls=(ToolCall("a", {}, "c3"),)),
    ]


def test_instructions_and_leading_developer_text_open_the_prompt_later_ones_join_a_user_turn():
    items = [_msg("developer", "d1"), _msg("system", "d2"), _msg("user", "u1"), _msg("developer", "late")]  # fmt: skip
    out = arrange("inst", parse_items(items, parse_tools({}), str))
    assert out == [Message("system", "inst\n\nd1\n\nd2"), Message("user", "u1\n\nlate")]
    after_tool = [Message("tool", "r", tool_call_id="c"), Message("system", "late")]
    assert arrange(None, after_tool) == [after_tool[0], Message("user", "late")]


@pytest.mark.parametrize(
    "effort,thinking", [("none", False), ("minimal", False), ("low", True), ("high", True)]
)
def test_reasoning_effort_switches_the_templates_thinking(effort, thinking):
    body = {"model": "m", "input": "x", "reasoning": {"effort": effort}}
    assert build(_request(), body).req.template_kwargs["enable_thinking"] is thinking
    body["chat_template_kwargs"] = {"enable_thinking": not thinking}  # the template's own wins
    assert build(_request(), body).req.template_kwargs["enable_thinking"] is not thinking


def test_the_response_store_is_bounded_lru_and_per_tenant():
    store = ResponseStore(max_bytes=14)  # two items of 7 JSON bytes each
    store.put("a", "t1", ({"x": 1},))
    store.put("b", "t1", ({"y": 2},))
    assert store.get("a", "t2") is None  # another tenant's id is unknown
    assert store.get("a", "t1") == ({"x": 1},)  # and now the most recent
    store.put("c", "t1", ({"z": 3},))
    assert store.get("b", "t1") is None and store.get("a", "t1") is not None and len(store) == 2


# ---------------------------------------------------------------------------------------
# A turn that reasons, writes and calls a namespaced tool (forced output, test-only hook)

FORCED = (
    "<think>\nA helper can do this.\n</think>\n\nSpawning one.\n"
    '<tool_call>{"name": "spawn_agent", "arguments": {"task": "write marker.txt"}}</tool_call>'
)


@pytest.fixture(scope="module")
def forced_server(demo_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("responses-forced")
    forced = root / "forced.json"
    forced.write_text(json.dumps({"outputs": [{"match": "[spawn]", "text": FORCED}]}))
    s = start_server(
        fresh_cache_dir(demo_root, root / "cache"), "--model", "demo-llama",
        "--upstream", "http://127.0.0.1:9", env={"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)},
    )  # fmt: skip
    yield s
    s.stop()


def test_reasoning_and_a_namespaced_call_stream_and_round_trip_into_the_cache(forced_server):
    client = openai.OpenAI(base_url=forced_server.url + "/v1", api_key="t", max_retries=0)
    body = copy.deepcopy(CODEX_BODY) | {"model": "demo-llama", "max_output_tokens": 200}
    body["input"] = [*body["input"][:3], _msg("user", "[spawn] make the marker")]
    del body["stream"]
    extra = {
        "extra_headers": HEADERS,
        "extra_body": {"client_metadata": body.pop("client_metadata")},
    }
    events = list(client.responses.create(**body, stream=True, **extra))
    final = events[-1].response
    assert final.status == "completed"
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = final.output
    assert reasoning.summary[0].text.strip() == "A helper can do this."
    assert message.content[0].text.strip() == "Spawning one."
    assert (call.name, call.namespace, json.loads(call.arguments)) == (
        "spawn_agent", "multi_agent_v1", {"task": "write marker.txt"},
    )  # fmt: skip
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[2].arguments == "" and added[2].call_id == call.call_id
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == [call.arguments]
    assert 0 < final.usage.output_tokens_details.reasoning_tokens < final.usage.output_tokens
    # Codex's next turn: the history as it re-sends it (summaries kept), plus the output.
    resent = [i.model_dump(exclude_none=True) for i in final.output]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "spawned"}
    body["input"] = [*body["input"], *resent, output]
    raw = client.responses.with_raw_response.create(**body | {"max_output_tokens": 2}, **extra)
    second = raw.parse()
    # Past the first prompt and its reasoning: the re-sent summary rendered as generated.
    hit = second.usage.input_tokens_details.cached_tokens
    assert hit > final.usage.input_tokens + final.usage.output_tokens_details.reasoning_tokens
    assert raw.headers["x-prompt-cache-hit-tokens"] == str(hit)


@pytest.mark.parametrize(
    "headers,want",
    [
        ({"thread-id": "t", "session-id": "s"}, "t"),  # a thread is one conversation
        ({"session-id": "s"}, "k"),
        ({"x-session-id": "x", "thread-id": "t"}, "x"),
        ({}, "k"),
    ],
)
def test_the_session_is_the_thread_then_prompt_cache_key_then_the_codex_session(headers, want):
    body = {"model": "m", "input": "x", "prompt_cache_key": "k"}
    assert build(_request(headers), body).req.session == want
