"""The controls clients send reach the model: tool_choice, parallel calls, thinking switches.

demo-hybrid speaks Qwen3.6's format (its template opens `<think>` in the generation
prompt); the forced-output hook makes it write exactly the given text, so each test sees
what a switch changed in the prompt or in the tokens the model could take. Each test runs
on demo-qwen36 too: the same template over the real vocabulary, where `<think>` and
`<tool_call>` are single tokens that the output rules open, ban and stop on.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.conftest import HYBRID_IDS, fresh_cache_dir, start_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            },
        },
    }
    for name in ("Bash", "Read")
]
A_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS
]
CALL = (
    "<tool_call>\n<function=Bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
)
READ = "<tool_call>\n<function=Read>\n<parameter=command>\na.txt\n</parameter>\n</function>\n</tool_call>"
FORCED = [
    {"match": "[case=hello]", "text": "Hello there."},
    {"match": "[case=two]", "text": f"Two calls.\n</think>\n\nLet me look.\n{CALL}\n{READ}"},
]


@pytest.fixture(scope="module")
def ctl_server(demo_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("controls")
    forced = root / "forced.json"
    forced.write_text(json.dumps({"outputs": FORCED}))
    cache_dir = fresh_cache_dir(demo_root, root / "cache")
    served = [arg for m in HYBRID_IDS for arg in ("--model", m)]
    server = start_server(
        cache_dir,
        "--upstream",
        "http://127.0.0.1:9",
        *served,
        env={"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)},
    )
    yield server
    server.stop()


@pytest.fixture(params=HYBRID_IDS)
def model(request) -> str:
    return request.param


@pytest.fixture
def oai(ctl_server):
    return openai.OpenAI(base_url=ctl_server.url + "/v1", api_key="t", max_retries=0)


@pytest.fixture
def ant(ctl_server):
    return anthropic.Anthropic(base_url=ctl_server.url, api_key="t", max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_thinking_on_by_default_the_open_think_makes_the_answer_reasoning(ant, model):
    msg = ant.messages.create(model=model, max_tokens=50, messages=user("[case=hello] hi"))
    assert [(b.type, getattr(b, "thinking", None)) for b in msg.content] == [
        ("thinking", "Hello there.")
    ]


def test_anthropic_thinking_disabled_reaches_the_templates_enable_thinking(ant, model):
    msg = ant.messages.create(
        model=model,
        max_tokens=50,
        messages=user("[case=hello] hi"),
        thinking={"type": "disabled"},
    )
    assert [(b.type, getattr(b, "text", None)) for b in msg.content] == [("text", "Hello there.")]


@pytest.mark.parametrize(
    "extra",
    [
        {"reasoning_effort": "none"},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    ],
    ids=["reasoning_effort", "chat_template_kwargs"],
)
def test_openai_switches_turn_thinking_off(oai, extra, model):
    r = oai.chat.completions.create(
        model=model, max_tokens=50, messages=user("[case=hello] hi"), temperature=0, **extra
    )
    m = r.choices[0].message
    assert (m.content, getattr(m, "reasoning_content", None)) == ("Hello there.", None)


def test_two_parallel_calls_each_get_their_own_index_and_block(oai, ant, model):
    r = oai.chat.completions.create(
        model=model,
        max_tokens=200,
        messages=user("[case=two] go"),
        tools=TOOLS,
        temperature=0,
    )
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("Bash", {"command": "ls"}),
        ("Read", {"command": "a.txt"}),
    ]
    assert r.choices[0].message.reasoning_content == "Two calls.\n"
    assert r.choices[0].message.content.strip() == "Let me look."  # text before a call is kept
    msg = ant.messages.create(
        model=model, max_tokens=200, messages=user("[case=two] go"), tools=A_TOOLS
    )
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use", "tool_use"]


def test_parallel_off_keeps_the_first_call_in_both_dialects(oai, ant, model):
    r = oai.chat.completions.create(
        model=model,
        max_tokens=200,
        messages=user("[case=two] go"),
        tools=TOOLS,
        parallel_tool_calls=False,
    )
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["Bash"]
    msg = ant.messages.create(
        model=model,
        max_tokens=200,
        messages=user("[case=two] go"),
        tools=A_TOOLS,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    assert [b.name for b in msg.content if b.type == "tool_use"] == ["Bash"]


def test_required_and_named_tool_choice_open_the_answer_with_the_call(oai, ctl_server, model):
    """Unforced random weights: the answer still opens with the call marker and, for a named
    tool, the family's header naming it (the rest is the random model's)."""
    import httpx

    body = {
        "model": model,
        "max_tokens": 12,
        "messages": user("unforced please"),
        "tools": TOOLS,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    for choice, opening in [
        ("required", "<tool_call>"),
        ({"type": "function", "function": {"name": "Read"}}, "<tool_call>\n<function=Read>\n"),
    ]:
        r = httpx.post(
            ctl_server.url + "/v1/chat/completions", json={**body, "tool_choice": choice}
        )
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        # Cut off by max_tokens inside the call, so it stays visible as text.
        assert content.startswith(opening), content


def test_bad_tool_choice_is_a_4xx_naming_the_field(oai, ant, model):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(
            model=model,
            max_tokens=5,
            messages=user("x"),
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "Nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        oai.chat.completions.create(
            model=model, max_tokens=5, messages=user("x"), reasoning_effort="lots"
        )
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        ant.messages.create(
            model=model,
            max_tokens=5,
            messages=user("x"),
            tools=A_TOOLS,
            tool_choice={"type": "sometimes"},
        )
