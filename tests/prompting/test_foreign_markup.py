"""A call written in another family's markup comes back structured; prose stays text.

demo-hybrid speaks Qwen3.6's format: its parser, mlx-lm's qwen3_coder, reads
`<tool_call><function=...>` only. The forced-output hook makes it write Hermes JSON inside
`<tool_call>` instead, which mlx-lm's json_tools parser reads (foreign_calls.py), through
the whole server path and the official SDKs; and where `../shared/templates/qwen3_6.jinja`
is present, the same on a model built on Qwen3.6's real template. The parser-level tests
below read other families' own markers (MiniMax's) at any chunking.
"""

from __future__ import annotations

import json

import pytest

from engine_bridge.models.demo import families, real_templates
from engine_bridge.prompting.output_format import OutputFormat
from engine_bridge.types import merge
from tests.conftest import QWEN36, fresh_cache_dir, start_server
from tests.prompting import test_tool_formats as tf
from tests.support.clients import forced_turn

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOLS_ANTHROPIC = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
TOOLS_BY_DIALECT = {"openai": TOOLS, "anthropic": TOOLS_ANTHROPIC}

REASONING = "The user wants the weather in Paris."
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Text that shows the tag without a call: a closed pair around what is not JSON, then an
# open tag the output ends inside. Both stay text, exactly as written.
PROSE = (
    'Wrap a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>, '
    "then use the <tool_call> tag to call tools."
)
# Valid Hermes JSON, but for a tool the request did not offer.
UNOFFERED = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
FORCED = [
    ("[case=hermes]", forced_turn(REASONING, HERMES)),
    ("[case=prose]", forced_turn(REASONING, PROSE)),
    ("[case=unoffered]", forced_turn(REASONING, UNOFFERED)),
]
REAL_QWEN36 = real_templates.templates_dir() / "qwen3_6.jinja"
WARNING = (
    "model {} wrote a tool call its qwen3_coder parser did not read; "
    "mlx-lm's json_tools parser read it"
)


@pytest.fixture(scope="module")
def foreign_server(demo_root, tmp_path_factory):
    """demo-hybrid, demo-qwen36 (the real vocabulary, where `<tool_call>` is one token),
    and a model on Qwen3.6's real template where it is present."""
    root = tmp_path_factory.mktemp("foreign")
    forced = root / "forced.json"
    forced.write_text(json.dumps({"outputs": [{"match": m, "text": t} for m, t in FORCED]}))
    args = ["--upstream", "http://127.0.0.1:9", "--model", "demo-hybrid", "--model", QWEN36]
    if REAL_QWEN36.is_file():
        path = families.write_family_model(root / "models" / "qwen3_6", "qwen3_coder", REAL_QWEN36)
        args += ["--model", str(path)]
    cache_dir = fresh_cache_dir(demo_root, root / "cache")
    server = start_server(cache_dir, *args, env={"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)})
    yield server
    server.stop()


def _model(server, name: str) -> str:
    if name == "qwen3_6" and not REAL_QWEN36.is_file():
        pytest.skip(f"{REAL_QWEN36} is absent")
    return tf._model_ids(server.url)[name]


def ask(server, model: str, case: str, dialect: str, stream: bool) -> tf.Answer:
    tools = TOOLS_BY_DIALECT[dialect]
    return tf.ASK[dialect](server.url, model, f"[case={case}]", stream, 300, tools=tools)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("name", ["demo-hybrid", QWEN36, "qwen3_6"])
def test_hermes_json_under_qwen36_comes_back_as_a_structured_call(
    foreign_server, name, dialect, stream
):
    answer = ask(foreign_server, _model(foreign_server, name), "hermes", dialect, stream)
    assert answer.calls == [("get_weather", {"city": "Paris"})], answer
    assert len(answer.call_ids) == 1 and answer.call_ids[0], answer
    assert answer.stop == tf.CALL_STOP[dialect]
    assert (answer.reasoning.strip(), answer.text) == (REASONING, ""), answer
    tf._no_markup(answer)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize(("case", "text"), [("prose", PROSE), ("unoffered", UNOFFERED)])
@pytest.mark.parametrize("model", ["demo-hybrid", QWEN36])
def test_text_that_shows_the_tag_without_an_offered_call_stays_text(
    foreign_server, case, text, dialect, stream, model
):
    answer = ask(foreign_server, model, case, dialect, stream)
    assert (answer.calls, answer.text) == ([], text), answer
    assert answer.stop == {"openai": "stop", "anthropic": "end_turn"}[dialect]


def test_the_fallback_is_logged_once_per_model_naming_the_parser_that_read_it(foreign_server):
    for stream in (False, True):
        assert ask(foreign_server, "demo-hybrid", "hermes", "openai", stream).calls
    assert foreign_server.log().count(WARNING.format("demo-hybrid")) == 1


# -- the parser alone, on demo-hybrid's tokenizer: other families' own markers ------------

MINIMAX = (
    '<minimax:tool_call>\n<invoke name="get_weather">\n'
    '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>'
)


@pytest.fixture(scope="module")
def hybrid(demo_root) -> OutputFormat:
    from mlx_lm.tokenizer_utils import load

    return OutputFormat.of(load(demo_root / "models" / "demo-hybrid"), model="demo-hybrid")


def _parts(fmt: OutputFormat, text: str, step: int, tools=TOOLS) -> list[tuple[str, object]]:
    p = fmt.parser(tools=tools)
    parts = []
    for i in range(0, len(text), step):
        parts += p.feed(text[i : i + step])
    parts = merge(parts + p.finish())
    return [(x.kind, (x.call.name, x.call.arguments) if x.call else x.text) for x in parts]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_minimax_markup_in_the_answer_is_read_by_minimax_s_parser(hybrid, step):
    assert _parts(hybrid, f"Checking.\n{MINIMAX}", step) == [
        ("text", "Checking."),
        ("tool_call", ("get_weather", {"city": "Paris"})),
    ]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    "text",
    [
        "Write <minimax:tool_call>your call</minimax:tool_call>\n\nthen wait.",
        "An open <minimax:tool_call> tag, never closed.",
        MINIMAX.replace("get_weather", "get_time"),
    ],
    ids=["closed-prose", "open-prose", "unoffered"],
)
def test_another_family_s_tags_around_no_offered_call_stay_text_exactly(hybrid, text, step):
    assert _parts(hybrid, text, step) == [("text", text)]


def test_without_tools_another_family_s_markup_is_text(hybrid):
    assert _parts(hybrid, MINIMAX, 5, tools=None) == [("text", MINIMAX)]
