"""Reasoning and tool calls are split out of streamed text, whatever the chunking.

The parser is the one the server builds for demo-llama, from its real tokenizer: Hermes
JSON calls (mlx-lm's json_tools, inferred from the chat template) and `<think>` markers.
The formats of the other families run through the whole server in test_tool_formats.py;
Muse Spark's, whose model needs Metal, runs here through its real tokenizer (below).
"""

from __future__ import annotations

import json

import pytest

from engine_bridge.prompting.output_format import OutputFormat, typed_arguments
from proxy.dialects.output import merge

TEXT = (
    "<think>\nThe user wants the weather.\n</think>\n\nLet me check."
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time", "x")
]


@pytest.fixture(scope="module")
def fmt(demo_root) -> OutputFormat:
    from mlx_lm.tokenizer_utils import load

    return OutputFormat.of(load(demo_root / "models" / "demo-llama"))


@pytest.fixture
def parse(fmt):
    def run(text: str, step: int, prompt: str = "", tools=TOOLS, reason: str = "stop"):
        p = fmt.parser(prompt_text=prompt, tools=tools)
        parts = []
        for i in range(0, len(text), step):
            parts += p.feed(text[i : i + step])
        parts += p.finish(reason)
        return merge(parts)

    return run


def test_demo_llama_speaks_hermes_json_as_mlx_lm_infers_it(fmt):
    assert (fmt.family, fmt.tool_call_start, fmt.tool_call_end) == (
        "json_tools",
        "<tool_call>",
        "</tool_call>",
    )
    assert (fmt.think_start, fmt.think_end) == ("<think>", "</think>")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_reasoning_text_and_tool_calls_split_at_any_chunking(parse, step):
    parts = parse(TEXT, step)
    assert [p.kind for p in parts] == ["reasoning", "text", "tool_call", "tool_call"]
    assert parts[0].text == "\nThe user wants the weather.\n"
    assert parts[1].text == "Let me check."
    assert (parts[2].call.name, parts[2].call.arguments) == ("get_weather", {"city": "Paris"})
    assert (parts[3].call.name, parts[3].call.arguments) == ("get_time", {"tz": "CET"})
    assert parts[2].call.id != parts[3].call.id


def test_prompt_that_opened_think_starts_in_reasoning(parse):
    parts = parse("planning</think>answer", 2, prompt="<|im_start|>assistant\n<think>\n")
    assert [(p.kind, p.text) for p in parts] == [("reasoning", "planning"), ("text", "answer")]


def test_prompt_whose_think_was_closed_starts_in_text(parse):
    parts = parse("answer", 2, prompt="assistant\n<think>\n\n</think>\n\n")
    assert [(p.kind, p.text) for p in parts] == [("text", "answer")]


def test_malformed_tool_call_is_kept_as_text(parse):
    parts = parse("<tool_call>{not json}</tool_call>", 3)
    assert [(p.kind, p.text) for p in parts] == [("text", "<tool_call>{not json}</tool_call>")]


def test_unterminated_tool_call_is_text_at_finish(parse):
    parts = parse('<tool_call>{"name": "x"', 4)
    assert [(p.kind, p.text) for p in parts] == [("text", '<tool_call>{"name": "x"')]


def test_call_cut_off_by_max_tokens_is_text_even_if_it_parses(parse, caplog):
    parts = parse('<tool_call>{"name": "x", "arguments": {}}', 4, reason="length")
    assert [(p.kind, p.text) for p in parts] == [
        ("text", '<tool_call>{"name": "x", "arguments": {}}')
    ]
    assert "cut off by max_tokens" in caplog.text


def test_tools_not_parsed_when_request_had_no_tools(parse):
    parts = parse('<tool_call>{"name": "x", "arguments": {}}</tool_call>', 5, tools=None)
    assert [p.kind for p in parts] == ["text"]


def test_one_call_only_keeps_the_first(fmt):
    p = fmt.parser(tools=TOOLS, parallel=False)
    parts = merge(p.feed(TEXT) + p.finish())
    assert [p.call.name for p in parts if p.kind == "tool_call"] == ["get_weather"]


def test_partial_tag_is_held_back_until_resolved(fmt):
    p = fmt.parser(tools=TOOLS)
    assert [x.text for x in p.feed("hello <th")] == ["hello "]
    assert [x.text for x in p.feed("ere")] == ["<there"]


def test_arguments_are_typed_by_the_tool_schema():
    props = {
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "ok": {"type": "boolean"},
        "opts": {"type": "object"},
        "ids": {"type": "array"},
        "name": {"type": "string"},
        "either": {"type": ["integer", "string"]},
    }
    args = {
        "n": "30",
        "x": "2.5",
        "ok": "true",
        "opts": '{"a": 1}',
        "ids": "[1, 2]",
        "name": "42",
        "either": "7",
        "unknown": "3",
    }
    assert typed_arguments(args, props) == {
        "n": 30,
        "x": 2.5,
        "ok": True,
        "opts": {"a": 1},
        "ids": [1, 2],
        "name": "42",
        "either": "7",
        "unknown": "3",
    }
    # A value that does not fit its type stays as the model wrote it.
    assert typed_arguments({"n": "thirty"}, props) == {"n": "thirty"}


def test_openai_and_anthropic_sdk_models_accept_tool_call_responses(parse):
    """The response builders' shapes validate against the SDKs' own types."""
    from anthropic.types import Message
    from openai.types.chat import ChatCompletion

    from proxy.dialects.anthropic_output import block_json
    from proxy.dialects.openai.chat import tool_call_json

    parts = parse(TEXT, 5)
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


# -- a response format with its own states: Muse Spark ---------------------------------------
# Its mlx-lm model runs Metal kernels only, so no Muse model runs here and the whole server
# path cannot; the tokenizer is real (mlx-lm applies muse_spark's TOKENIZER_DEFAULTS: its
# response format and parser) and its own streaming detokenizer feeds the parser.

MUSE_REASONING = "I should list the files."
MUSE_CALL = (
    f" to=self<|message|>{MUSE_REASONING}<|eom|>"
    "<|start|>assistant to=Bash<|message|><atem:function_calls>\n"
    '<atem:invoke name="Bash">\n<atem:parameter name="command">ls -la</atem:parameter>\n'
    '<atem:parameter name="timeout">30</atem:parameter>\n</atem:invoke>\n'
    '<atem:invoke name="Read">\n<atem:parameter name="file_path">README.md</atem:parameter>\n'
    "</atem:invoke>\n</atem:function_calls>"
)
MUSE_ANSWER = (
    f" to=self<|message|>{MUSE_REASONING}<|eom|>"
    "<|start|>assistant to=user<|message|>Two files: a.txt and b.txt.<|eot|>"
)
MUSE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in props}},
        },
    }
    for name, props in (
        ("Bash", (("command", "string"), ("timeout", "integer"))),
        ("Read", (("file_path", "string"),)),
    )
]


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer
    from tokenizers import AddedToken, Tokenizer

    from engine_bridge.models.demo import tokenizer

    out = tmp_path_factory.mktemp("muse")
    data = json.loads(tokenizer.train_tokenizer().to_str())
    for added in data["added_tokens"]:  # no <think> in Muse's vocabulary
        added["content"] = {"<think>": "<|start|>", "</think>": "<|message|>"}.get(
            added["content"], added["content"]
        )
    tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|eom|>", "<|eot|>")])
    tokenizer.write_tokenizer_files(tok, out, eos_token="<|eot|>")
    # The model type is what makes mlx-lm apply muse_spark's defaults.
    (out / "config.json").write_text(json.dumps({"model_type": "muse_spark"}))
    return load_tokenizer(out)


def _stream(tok, fmt: OutputFormat, text: str, tools) -> list:
    """The parts of `text` as the server reads them: token by token through the
    tokenizer's streaming detokenizer."""
    p = fmt.parser(prompt_text="<|start|>assistant", tools=tools)
    detok = tok.detokenizer
    detok.reset()
    parts = []
    for token in tok.encode(text, add_special_tokens=False):
        detok.add_token(token)
        parts += p.feed(detok.last_segment)
    detok.finalize()
    parts += p.feed(detok.last_segment)
    return merge(parts + p.finish())


def test_muse_spark_reads_its_response_format_from_mlx_lm(muse):
    fmt = OutputFormat.of(muse)
    assert fmt.family == "muse_spark" and fmt.response_initial == "header"
    assert fmt.tool_call_start == "<atem:function_calls>"
    assert dict(fmt.response)["reasoning"] == (("<|eom|>", "header"),)


@pytest.mark.parametrize("tools", [MUSE_TOOLS, None], ids=["tools", "no-tools"])
def test_muse_spark_headers_are_dropped_and_reasoning_answer_and_calls_split(muse, tools):
    fmt = OutputFormat.of(muse)
    answer = _stream(muse, fmt, MUSE_ANSWER, tools)
    assert [(p.kind, p.text.strip()) for p in answer] == [
        ("reasoning", MUSE_REASONING),
        ("text", "Two files: a.txt and b.txt."),
    ]
    if tools is None:
        return
    call = _stream(muse, fmt, MUSE_CALL, tools)
    assert [p.kind for p in call] == ["reasoning", "tool_call", "tool_call"]
    assert call[0].text.strip() == MUSE_REASONING
    assert [(p.call.name, p.call.arguments) for p in call[1:]] == [
        ("Bash", {"command": "ls -la", "timeout": 30}),
        ("Read", {"file_path": "README.md"}),
    ]
