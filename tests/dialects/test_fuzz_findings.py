"""What fuzzing found: valid requests that got a 500 before their fix."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import DEMO_IDS


@pytest.mark.parametrize("model", DEMO_IDS)
@pytest.mark.parametrize("prompt", [[5], "a"], ids=["one-token-id", "one-char"])
def test_a_one_token_prompt_is_answered_on_every_cache_kind(server, model, prompt):
    # Hybrid and sliding-window models checkpointed the end of prefill at position 0,
    # which the checkpoint code rightly refuses.
    for _ in range(2):  # the second one looks the first one up
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 1


def test_top_k_above_the_vocabulary_keeps_every_token(server):
    # mlx-lm refuses a top_k of vocabulary size or more; "the top k" of fewer is all of them.
    for top_k in (4095, 4096, 30_268_427):
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={
                "model": "demo-llama",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "top_k": top_k,
            },
            timeout=60,
        )
        assert r.status_code == 200, (top_k, r.text)


def test_any_integer_seed_is_one_reproducible_key_stream(server):
    # MLX keys are unsigned 64-bit: -1 (which some clients send) and 2**64 were a 500.
    def text(seed: int) -> str:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": "demo-llama", "prompt": "The cache", "max_tokens": 6, "seed": seed},
            headers={"x-prompt-cache": "bypass"},
            timeout=60,
        )
        assert r.status_code == 200, (seed, r.text)
        return r.json()["choices"][0]["text"]

    assert text(-1) == text(-1) == text(2**64 - 1)
    assert text(2**64) == text(0)


# A value nested ~1000 deep, as JSON text: json.dumps itself would recurse too far.
DEEP = '{"a":' * 990 + "1" + "}" * 990
CHAT = '"messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize(
    "route,body,field",
    [
        # An unhashable role was looked up in a set: TypeError.
        ("/v1/chat/completions", '"messages": [{"role": {}, "content": "x"}]', "role"),
        ("/v1/messages", '"messages": [{"role": {}, "content": "x"}]', "role"),
        # repr() of the value, for the message, raised RecursionError.
        ("/v1/completions", f'"prompt": [0, {DEEP}]', "prompt[1]"),
        ("/v1/chat/completions", f'"messages": [{{"role": {DEEP}, "content": "x"}}]', "role"),
        ("/v1/messages", f'"messages": [{{"role": {DEEP}, "content": "x"}}]', "role"),
        (
            "/v1/messages",
            f'"messages": [{{"role": "user", "content": [{{"type": {DEEP}}}]}}]',
            "messages[0].content[0].type",
        ),
        ("/v1/chat/completions", f'{CHAT}, "top_p": {DEEP}', "top_p"),
        # A thinking block's text went into str.join unchecked.
        (
            "/v1/messages",
            '"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": [1]}]}]',
            "messages[0].content[0].thinking",
        ),
        # Nested past what the template and the prefix hash can recurse through, where
        # the template's refusal blamed "messages" and json.dumps raised RecursionError.
        (
            "/v1/chat/completions",
            f'{CHAT}, "tools": [{{"type": "function", "function": {{"name": "f", "parameters": {DEEP}}}}}]',
            "tools[0].function.parameters.a.a",
        ),
        ("/v1/chat/completions", f'{CHAT}, "chat_template_kwargs": {DEEP}', "chat_template_kwargs"),
        (
            "/v1/messages",
            f'{CHAT}, "tools": [{{"name": "t", "input_schema": {DEEP}}}]',
            "tools[0].input_schema",
        ),
        # An Anthropic tool type was looked up in a set: a list there was a TypeError.
        ("/v1/messages", f'{CHAT}, "tools": [{{"name": "t", "type": [1]}}]', "tools[0].type"),
        (
            "/v1/messages/count_tokens",
            f'{CHAT}, "tools": [{{"name": "t", "type": {{}}}}]',
            "tools[0].type",
        ),
    ],
)
def test_odd_values_in_named_fields_are_a_400_not_a_500(server, route, body, field):
    raw = '{"model": "demo-llama", "max_tokens": 2, ' + body + "}"
    r = httpx.post(
        server.url + route,
        content=raw.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


# A JSON "\udcff" escape: valid syntax, but a lone surrogate, which no UTF-8 text holds.
LONE = '"a\\udcffb"'
JUNK = '{"role": "user", "content": [{"type": "text", "text": "x", "\\u00e5": [{}, null]}]}'


def _openai_error(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/cache/probe", f'"user": {LONE}, "messages": [{JUNK}]', "user"),
        ("/v1/cache/warm", f'"user": {LONE}, "messages": [{JUNK}]', "user"),
        ("/v1/chat/completions", f'"user": {LONE}, "messages": [{JUNK}]', "user"),
        (
            "/v1/cache/probe",
            f'"messages": [{{"role": "user", "content": {LONE}}}]',
            "messages[0].content",
        ),
        ("/v1/cache/warm", f'"messages": [{JUNK}, {{"role": {LONE}}}]', "messages[1].role"),
        ("/v1/completions", f'"prompt": {LONE}', "prompt"),
        ("/v1/chat/completions", f'{CHAT}, "stop": ["x", {LONE}]', "stop[1]"),
    ],
)
def test_a_lone_surrogate_escape_is_a_400_naming_its_field(server, route, body, param):
    raw = '{"model": "demo-llama", "max_tokens": 2, ' + body + "}"
    r = httpx.post(
        server.url + route,
        content=raw.encode(),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    _openai_error(r, param)
    assert "lone surrogate" in r.json()["error"]["message"]


def test_a_lone_surrogate_in_an_anthropic_body_is_a_400_in_its_shape(server):
    raw = '{"model": "demo-llama", "max_tokens": 2, "metadata": {"user_id": ' + LONE + "}, "
    raw += CHAT + "}"
    for route in ("/v1/messages", "/v1/cache/probe"):
        r = httpx.post(
            server.url + route,
            content=raw.encode(),
            # Probe reads the body's dialect from the body, unless this header says it.
            headers={"content-type": "application/json", "anthropic-version": "2023-06-01"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json() == {
            "type": "error",
            "error": {
                "type": "invalid_request_error",
                "message": "metadata.user_id: the string holds a lone surrogate escape "
                "(\\ud800-\\udfff without its pair), which is not a character (I-JSON, RFC 7493)",
            },
        }


# aiohttp decodes header bytes that are not UTF-8 as lone surrogates ("\xff" -> "\udcff"):
# the tenant went into the cache's hash (a 500 on every generation route, probe and warm),
# a session id into the session registry's SQLite rows (its save failed for everyone).
@pytest.mark.parametrize("name", ["x-tenant", "x-session-id", "X-Claude-Code-Session-Id"])
@pytest.mark.parametrize(
    "route",
    [
        "/v1/cache/probe",
        "/v1/cache/warm",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/api/v0/chat/completions",
    ],
)
def test_a_header_that_is_not_utf8_is_a_400_naming_it(server, route, name):
    body = {"model": "demo-llama", "max_tokens": 2, "temperature": 0}
    if route == "/v1/completions":
        body["prompt"] = "hi"
    elif route == "/v1/responses":
        body = {"model": "demo-llama", "max_output_tokens": 16, "input": "hi"}
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    r = httpx.post(server.url + route, json=body, headers={name: b"a\xffb"}, timeout=60)
    _openai_error(r, name)
    assert r.json()["error"]["message"] == f"{name}: header is not valid UTF-8"
    assert r.json()["error"]["code"] == "invalid_header"


def test_a_tenant_header_that_is_not_utf8_is_a_400_in_anthropic_shape(server):
    body = {"model": "demo-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(
        server.url + "/v1/messages", json=body, headers={"x-tenant": b"\xff"}, timeout=60
    )
    assert r.status_code == 400, r.text
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "x-tenant: header is not valid UTF-8",
        },
    }


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("DELETE", "/v1/cache/sessions/x%0Ay"),
        ("POST", "/v1/cache/sessions/x%0Ay/pin"),
        ("POST", "/v1/cache/sessions/x%0Ay/unpin"),
    ],
)
def test_a_path_no_route_matches_gets_the_documented_json_404(server, method, path):
    # Fuzzing (seed 20261205): a session id holding a newline matched no route, not even
    # the catch-all, and aiohttp answered its own text/plain 404.
    r = httpx.request(method, server.url + path, timeout=30)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    assert "no route for" in r.json()["error"]["message"]
