"""Every model family's tool calls and reasoning, through the whole server path.

The server runs with the test-only forced-output hook: the model is made to emit, token by
token, the family's real markup (reasoning first, then one call, two calls, or a call cut
off by max_tokens). The text goes through the real sampler, detokenizer, parser and SSE
writer, and the official SDKs read it. Every family mlx-lm has a parser for is covered,
plus Hermes (demo-llama's template), Qwen3.6's XML form (demo-hybrid's) and gpt-oss harmony,
except Muse Spark: its mlx-lm model runs on Metal only, so test_output_parser.py reads its
markup through its real tokenizer instead.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine_bridge.models.demo import families
from tests.conftest import QWEN36, fresh_cache_dir, start_server

TOOLS_OPENAI = families.TOOLS
TOOLS_ANTHROPIC = families.TOOLS_ANTHROPIC
# Markup no client may see in any answer, whatever the family.
MARKUP = (
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "<parameter=",
    "<think>",
    "</think>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "<|tool_call>",
    "<tool_call|>",
    "<arg_key>",
    "<|channel|>",
    "<|message|>",
    "<|start|>",
    "<|channel>",
    "<channel|>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<minimax:tool_call>",
    "<invoke",
    "<|tool_call_start|>",
    "<start_function_call>",
    "<longcat_tool_call>",
    "<function name=",
    "<|open|>",
    "<|close|>",
    "<|sep|>",
)


@dataclass(frozen=True)
class Case:
    family: str
    scenario: str  # one, two, cut
    model: str

    @property
    def tag(self) -> str:
        return f"[case={self.family}-{self.scenario}]"


# Our user's model shape writes Qwen3.6's XML form (demo-hybrid's family) through its real
# 248k vocabulary, where `<tool_call>` and `<think>` are single tokens of their own.
ON_DEMO = {"qwen36": ("qwen3_coder", QWEN36)}
FAMILY_NAMES = (*families.FAMILIES, *ON_DEMO)
SCENARIOS = ("one", "two", "cut")


def family_of(name: str) -> families.Family:
    return families.FAMILIES[ON_DEMO[name][0] if name in ON_DEMO else name]


@pytest.fixture(scope="module")
def fam_server(demo_root, tmp_path_factory):
    """One server with a model per family and a forced output per (family, scenario)."""
    root = tmp_path_factory.mktemp("families")
    cache_dir = fresh_cache_dir(demo_root, root / "cache")
    models: dict[str, str] = {}
    outputs = []
    cut_tokens: dict[str, int] = {}
    for name in FAMILY_NAMES:
        fam = family_of(name)
        if name in ON_DEMO:
            path = cache_dir / "models" / ON_DEMO[name][1]
        else:
            path = families.write_family_model(root / "models" / name, name)
        models[name] = str(path)
        for scenario in SCENARIOS:
            example = fam.two_calls if scenario == "two" else fam.one_call
            if example is not None:
                outputs.append({"match": f"[case={name}-{scenario}]", "text": example.text})
        cut_tokens[name] = _tokens_into_the_call(path, fam)
    forced = root / "forced.json"
    forced.write_text(json.dumps({"outputs": outputs}))
    args = ["--upstream", "http://127.0.0.1:9"]
    for name, path in models.items():
        args += ["--model", ON_DEMO[name][1] if name in ON_DEMO else path]
    server = start_server(cache_dir, *args, env={"MLX_PROMPT_CACHE_FORCE_OUTPUT": str(forced)})
    ids = _model_ids(server.url)
    yield server, {name: ids[Path(p).name] for name, p in models.items()}, cut_tokens, models
    server.stop()


def _model_ids(url: str) -> dict[str, str]:
    import httpx

    data = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    return {Path(m["id"]).name: m["id"] for m in data}


@functools.cache
def _tokenizer(path: Path):
    """A family model's tokenizer, loaded once for the module (Qwen3.6's 248k vocabulary
    takes seconds)."""
    from mlx_lm.tokenizer_utils import load

    return load(path)


def _tokens_into_the_call(path: Path, fam: families.Family) -> int:
    """max_tokens that stops the one-call text a few characters into its call."""
    tok = _tokenizer(Path(path))
    text = fam.one_call.text
    start = call_marker(fam, tok)
    cut = text.index(start) + len(start) + 4
    return len(tok.encode(text[:cut], add_special_tokens=False))


def call_marker(fam: families.Family, tok) -> str:
    """Where a call begins in the family's text: the parser's start marker, or for
    harmony (no parser) the arguments' body."""
    return '<|message|>{"' if fam.parser is None else tok.tool_call_start


def _calls(example: families.Example) -> list[tuple[str, dict]]:
    return [(c["name"], c["arguments"]) for c in example.calls]


@dataclass
class Answer:
    """What a client read back, in either dialect."""

    text: str
    reasoning: str
    calls: list[tuple[str, dict]]
    call_ids: list[str]
    stop: str
    headers: dict[str, str]


def ask_openai(
    url: str, model: str, tag: str, stream: bool, max_tokens: int, tools=TOOLS_OPENAI
) -> Answer:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="t", max_retries=0, timeout=120)
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": f"{tag} list the files"}],
        tools=tools,
        max_tokens=max_tokens,
        temperature=0,
    )
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**kw)
        r = raw.parse()
        m = r.choices[0].message
        calls = m.tool_calls or []
        return Answer(
            m.content or "",
            getattr(m, "reasoning_content", None) or "",
            [(c.function.name, json.loads(c.function.arguments)) for c in calls],
            [c.id for c in calls],
            r.choices[0].finish_reason,
            dict(raw.headers),
        )
    text, reasoning, stop = "", "", None
    by_index: dict[int, dict] = {}
    with client.chat.completions.with_streaming_response.create(**kw, stream=True) as raw:
        headers = dict(raw.headers)
        for chunk in raw.parse():
            choice = chunk.choices[0]
            d = choice.delta
            text += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                if tc.index not in by_index:
                    # The first delta of a call names it, before any arguments.
                    assert tc.id and tc.function.name, tc
                    by_index[tc.index] = {"id": tc.id, "name": tc.function.name, "args": ""}
                by_index[tc.index]["args"] += tc.function.arguments or ""
            stop = choice.finish_reason or stop
    calls = [by_index[i] for i in sorted(by_index)]
    return Answer(
        text,
        reasoning,
        [(c["name"], json.loads(c["args"])) for c in calls],
        [c["id"] for c in calls],
        stop,
        headers,
    )


def ask_anthropic(
    url: str, model: str, tag: str, stream: bool, max_tokens: int, tools=TOOLS_ANTHROPIC
) -> Answer:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="t", max_retries=0, timeout=120)
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": f"{tag} list the files"}],
        tools=tools,
        max_tokens=max_tokens,
    )
    if not stream:
        raw = client.messages.with_raw_response.create(**kw)
        msg, headers = raw.parse(), dict(raw.headers)
    else:
        with client.messages.stream(**kw) as s:
            kinds = []
            for event in s:
                if event.type == "content_block_start":
                    kinds.append(event.content_block.type)
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    # Anthropic's order: a tool_use block opens, then its input as JSON.
                    assert kinds[-1] == "tool_use"
            msg = s.get_final_message()
            headers = dict(s.response.headers)
    blocks = msg.content
    return Answer(
        "".join(b.text for b in blocks if b.type == "text"),
        "".join(b.thinking for b in blocks if b.type == "thinking"),
        [(b.name, b.input) for b in blocks if b.type == "tool_use"],
        [b.id for b in blocks if b.type == "tool_use"],
        msg.stop_reason,
        headers,
    )


ASK = {"openai": ask_openai, "anthropic": ask_anthropic}
CALL_STOP = {"openai": "tool_calls", "anthropic": "tool_use"}
LENGTH_STOP = {"openai": "length", "anthropic": "max_tokens"}


def _no_markup(answer: Answer) -> None:
    leaked = [m for m in MARKUP if m in answer.text or m in answer.reasoning]
    assert not leaked, (leaked, answer)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_a_familys_calls_come_back_structured_with_typed_arguments(
    fam_server, family, dialect, stream
):
    server, ids, cut_tokens, _ = fam_server
    fam = family_of(family)
    ask = ASK[dialect]
    model = ids[family]

    one = ask(server.url, model, f"[case={family}-one]", stream, 300)
    assert one.calls == _calls(fam.one_call), one
    assert one.stop == CALL_STOP[dialect]
    assert one.reasoning.strip() == fam.one_call.reasoning
    assert one.text == ""  # not even the layout newlines before the call
    _no_markup(one)

    if fam.two_calls is not None:
        two = ask(server.url, model, f"[case={family}-two]", stream, 300)
        assert two.calls == _calls(fam.two_calls), two
        assert len(set(two.call_ids)) == 2 and all(two.call_ids)
        assert two.stop == CALL_STOP[dialect]
        assert two.reasoning.strip() == fam.two_calls.reasoning
        _no_markup(two)

    # Cut off by max_tokens inside the call: visible as text, never a 500 or a call.
    cut = ask(server.url, model, f"[case={family}-cut]", stream, cut_tokens[family])
    assert cut.calls == [] and cut.stop == LENGTH_STOP[dialect], cut
    assert cut.text.strip(), cut


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_cache_keeps_hitting_across_a_tool_turn(fam_server, family):
    """Turn 2 (the call and its result appended) restores at least all of turn 1's prompt."""
    import openai

    server, ids, _, _ = fam_server
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0)
    messages = [{"role": "user", "content": f"[case={family}-one] list the files, turn test"}]
    kw = dict(model=ids[family], tools=TOOLS_OPENAI, max_tokens=200, temperature=0)
    first = client.chat.completions.create(messages=messages, **kw)
    m = first.choices[0].message
    assert m.tool_calls, m
    assistant = {
        "role": "assistant",
        "content": m.content,
        "tool_calls": [c.model_dump() for c in m.tool_calls],
    }
    if getattr(m, "reasoning_content", None):
        assistant["reasoning_content"] = m.reasoning_content
    result = {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "a.txt\nb.txt"}
    raw = client.chat.completions.with_raw_response.create(
        messages=[*messages, assistant, result], **kw
    )
    second = raw.parse()
    hit = int(raw.headers["x-prompt-cache-hit-tokens"])
    assert second.usage.prompt_tokens_details.cached_tokens == hit
    assert hit >= first.usage.prompt_tokens, (hit, first.usage.prompt_tokens)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_usage_counts_the_reasoning_blocks_tokens(fam_server, family):
    """reasoning_tokens: the tokens of the reasoning and its markers, no fewer than the
    reasoning's own and no more than everything written before the call."""
    import openai

    server, ids, _, paths = fam_server
    fam = family_of(family)
    tok = _tokenizer(Path(paths[family]))
    text = fam.one_call.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0)
    messages = [{"role": "user", "content": f"[case={family}-one] list the files"}]
    for route in ("chat", "responses"):
        if route == "chat":
            r = client.chat.completions.create(
                model=ids[family], messages=messages, tools=TOOLS_OPENAI, max_tokens=300
            )
            counted, total = (
                r.usage.completion_tokens_details.reasoning_tokens,
                r.usage.completion_tokens,
            )
        else:
            r = client.responses.create(
                model=ids[family],
                input=messages[0]["content"],
                tools=[{"type": "function", **t["function"]} for t in TOOLS_OPENAI],
                max_output_tokens=300,
            )
            counted, total = r.usage.output_tokens_details.reasoning_tokens, r.usage.output_tokens
        own = len(tok.encode(fam.one_call.reasoning, add_special_tokens=False))
        before_call = len(
            tok.encode(text[: text.index(call_marker(fam, tok))], add_special_tokens=False)
        )
        assert own <= counted <= before_call < total, (route, own, counted, before_call, total)
