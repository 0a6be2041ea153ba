"""Hypothesis strategies for hostile OpenAI and Anthropic request bodies, sent as raw JSON.

Bodies are plain Python values with `Raw` pieces spliced in: JSON text written as it is,
for what `json.dumps` will not produce (NaN, Infinity, lone surrogate escapes, nesting
deeper than any recursive encoder allows). `encode` turns a body into the bytes to send.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

MODELS = ("demo-llama", "demo-hybrid", "demo-swa")
# The routes fuzzed here and their dialect; the LM Studio routes share OpenAI's parsers.
ROUTES = {
    "/v1/chat/completions": "openai",
    "/v1/completions": "openai",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
}


class Raw(str):
    """JSON text spliced into a body as it is."""


def encode(value: Any) -> bytes:
    return _text(value).encode("utf-8", errors="surrogatepass")


def _text(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------
# Leaves

ODD = [
    "\x00",  # NUL
    "\u202e",  # right-to-left override
    "\u200f",  # right-to-left mark
    "\u200d",  # zero-width joiner
    "\ufeff",  # byte order mark
    "\u0301",  # a combining accent with nothing to combine with
    "\U0001f600",
    "\U0001f468\u200d\U0001f469\u200d\U0001f467",  # one emoji of five code points
    "\uffff",
    "\U0010ffff",
    "\u0085\u2028\u2029",  # NEL, line and paragraph separators
    "\\",
    '"',
    "{{ raise('x') }}",  # what a Jinja template would run if it evaluated content
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</think>",
    "عربي",
    "עברית",
]
odd_text = st.lists(st.one_of(st.sampled_from(ODD), st.characters()), max_size=12).map("".join)
# Past every demo model's context (32k tokens), even for a tokenizer that merges runs.
huge_text = st.builds(
    lambda unit, n: unit * n,
    st.sampled_from(["\U0001f600", "\u202e\x00", "a\u0301", "עב ", "\x00"]),
    st.integers(40_000, 120_000),
)

# Valid JSON that is odd to decode: surrogate pairs as escapes, -0, exponents, long digits.
raw_odd_but_valid = st.sampled_from(
    [
        Raw('"\\ud83d\\ude00"'),
        Raw('"\\u0000"'),
        Raw("-0"),
        Raw("1e308"),
        Raw("1e999"),
        Raw("-1e999"),
        Raw("4.9e-324"),
        Raw("123456789012345678901234567890"),
        Raw("-9223372036854775809"),
        Raw("18446744073709551616"),
    ]
)
# Not JSON at all, though Python's json module would write or accept some of it.
raw_not_json = st.sampled_from(
    [
        Raw("NaN"),
        Raw("Infinity"),
        Raw("-Infinity"),
        Raw('"\\ud800"'),  # a lone high surrogate
        Raw('"\\udfff"'),  # a lone low surrogate
        Raw('"\\ud83d"'),
        Raw('"\\ude00\\ud83d"'),  # a pair in the wrong order
        Raw("undefined"),
        Raw("0x10"),
        Raw("'single'"),
    ]
)


def deep(depth: int, kind: str) -> Raw:
    if kind == "[":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


deep_value = st.builds(
    deep,
    st.sampled_from([8, 64, 200, 500, 900, 1000, 1023, 1024, 1100, 5000]),
    st.sampled_from("[{"),
)
scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**63), max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    odd_text,
    raw_odd_but_valid,
)
junk = st.recursive(
    scalar,
    lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(odd_text, kids, max_size=3)),
    max_leaves=8,
)
wrong = st.one_of(junk, junk, junk, deep_value, huge_text)

# ---------------------------------------------------------------------------------------
# Bodies

IMAGE_URL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
not_a_schema = st.one_of(
    junk,
    deep_value,
    st.just({"type": 5}),
    st.just({"type": "object", "properties": "x"}),
    st.just({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    st.just({"type": "object", "required": [None, 1]}),
)
a_schema = st.just({"type": "object", "properties": {"q": {"type": "string"}}})


def bodies(hostile: bool) -> dict[str, st.SearchStrategy]:
    """A body strategy per route. Hostile bodies add what the proxy may refuse (images,
    unknown block types, tool schemas that are not schemas, prompts past the context);
    the others are all accepted, so a mutation of one is the only fault in it."""

    def pick(clean, *extra):
        return st.one_of(clean, *extra) if hostile else clean

    text = pick(odd_text, odd_text, odd_text, huge_text)
    tool_schema = pick(a_schema, not_a_schema)
    unknown_block = st.one_of(
        st.fixed_dictionaries({"type": odd_text}),
        st.just({"type": "document", "source": {"type": "text", "data": "x"}}),
        st.just({"type": "web_search_tool_result", "content": []}),
    )

    # OpenAI
    openai_part = pick(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text"]), "text": text}),
        st.just({"type": "image_url", "image_url": {"url": IMAGE_URL}}),
        st.just({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
        st.fixed_dictionaries({"type": odd_text}),
    )
    openai_content = st.one_of(text, st.lists(openai_part, max_size=3), st.none())
    arguments = pick(
        st.one_of(odd_text, st.just('{"q": 1}'), st.dictionaries(odd_text, junk, max_size=2)),
        junk,
    )
    openai_call = st.fixed_dictionaries(
        {
            "id": odd_text,
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": odd_text, "arguments": arguments}),
        }
    )
    openai_message = st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "developer", "user"]), "content": openai_content}
        ),
        st.fixed_dictionaries(
            {"role": st.just("assistant"), "content": openai_content},
            optional={
                "tool_calls": st.lists(openai_call, max_size=2),
                "reasoning_content": odd_text,
            },
        ),
        st.fixed_dictionaries(
            {"role": st.sampled_from(["tool", "function"]), "content": openai_content},
            optional={"tool_call_id": odd_text, "name": odd_text},
        ),
    )
    openai_tool = st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": odd_text},
                optional={"description": odd_text, "parameters": tool_schema},
            ),
        }
    )
    openai_sampling = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "top_k": st.integers(0, 100_000),
        "min_p": st.floats(0, 1),
        "repetition_penalty": st.floats(0.5, 2),
        "seed": st.integers(),
        "stop": st.one_of(odd_text, st.lists(odd_text, max_size=3)),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "user": odd_text,
        "n": st.just(1),
    }
    openai_chat = st.fixed_dictionaries(
        {
            "model": st.sampled_from(MODELS),
            "messages": st.lists(openai_message, min_size=1, max_size=3),
            "max_tokens": st.integers(1, 4),
        },
        optional={
            **openai_sampling,
            "tools": st.lists(openai_tool, max_size=2),
            "tool_choice": pick(st.sampled_from(["auto", "none", "required"]), junk),
            "chat_template_kwargs": pick(
                st.just({"enable_thinking": False}), st.dictionaries(odd_text, junk, max_size=2)
            ),
        },
    )
    openai_completion = st.fixed_dictionaries(
        {
            "model": st.sampled_from(MODELS),
            "prompt": st.one_of(
                pick(st.text(min_size=1, max_size=20), text),
                st.lists(st.integers(0, 4095), min_size=1, max_size=8),
                st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=1),
            ),
            "max_tokens": st.integers(1, 4),
        },
        optional=openai_sampling,
    )

    # Anthropic
    anthropic_text = st.fixed_dictionaries({"type": st.just("text"), "text": text})
    image_block = st.just(
        {
            "type": "image",
            "source": {
                "type": "base64",
                "media_type": "image/png",
                "data": IMAGE_URL.split(",")[1],
            },
        }
    )
    user_block = pick(
        st.one_of(
            anthropic_text,
            st.fixed_dictionaries(
                {
                    "type": st.just("tool_result"),
                    "tool_use_id": odd_text,
                    "content": st.one_of(text, st.lists(anthropic_text, max_size=2)),
                },
                optional={"is_error": st.booleans()},
            ),
        ),
        image_block,
        unknown_block,
    )
    assistant_block = pick(
        st.one_of(
            anthropic_text,
            st.fixed_dictionaries(
                {"type": st.just("thinking"), "thinking": odd_text, "signature": odd_text}
            ),
            st.just({"type": "redacted_thinking", "data": "abc"}),
            st.fixed_dictionaries(
                {
                    "type": st.just("tool_use"),
                    "id": odd_text,
                    "name": odd_text,
                    "input": st.dictionaries(odd_text, junk, max_size=2),
                }
            ),
        ),
        unknown_block,
    )
    anthropic_message = st.one_of(
        st.fixed_dictionaries(
            {"role": st.just("user"), "content": st.one_of(text, st.lists(user_block, max_size=3))}
        ),
        st.fixed_dictionaries(
            {
                "role": st.just("assistant"),
                "content": st.one_of(text, st.lists(assistant_block, max_size=3)),
            }
        ),
        st.fixed_dictionaries(
            {"role": st.just("system"), "content": st.one_of(text, st.lists(anthropic_text))}
        ),
    )
    anthropic_tool = st.fixed_dictionaries(
        {"name": odd_text},
        optional={
            "description": odd_text,
            "input_schema": tool_schema,
            "type": st.sampled_from(["custom", "web_search_20250305", "bash_20250124"]),
        },
    )
    conversation = {
        "system": st.one_of(text, st.lists(anthropic_text, max_size=2)),
        "tools": st.lists(anthropic_tool, max_size=2),
        # A named choice must name one of the tools, which these bodies draw apart from it:
        # only hostile bodies name one, as a wrong value.
        "tool_choice": pick(
            st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none"])}),
            st.fixed_dictionaries({"type": st.just("tool"), "name": odd_text}),
        ),
    }
    anthropic_messages = st.fixed_dictionaries(
        {
            "model": st.sampled_from(MODELS),
            "messages": st.lists(anthropic_message, min_size=1, max_size=3),
            "max_tokens": st.integers(1, 4),
        },
        optional={
            **conversation,
            "temperature": st.floats(0, 1),
            "top_p": st.floats(0, 1),
            "top_k": st.integers(0, 100_000),
            "stop_sequences": st.lists(odd_text, max_size=3),
            "stream": st.booleans(),
            "metadata": st.fixed_dictionaries({"user_id": odd_text}),
            "thinking": st.fixed_dictionaries(
                {
                    "type": st.sampled_from(["enabled", "disabled", "adaptive"]),
                    "budget_tokens": st.integers(1, 2048),
                }
            ),
        },
    )
    anthropic_count = st.fixed_dictionaries(
        {
            "model": st.sampled_from(MODELS),
            "messages": st.lists(anthropic_message, min_size=1, max_size=3),
        },
        optional=conversation,
    )
    return {
        "/v1/chat/completions": openai_chat,
        "/v1/completions": openai_completion,
        "/v1/messages": anthropic_messages,
        "/v1/messages/count_tokens": anthropic_count,
    }


def route_and_body(hostile: bool) -> st.SearchStrategy[tuple[str, dict]]:
    by_route = bodies(hostile)
    return st.sampled_from(sorted(by_route)).flatmap(
        lambda route: st.tuples(st.just(route), by_route[route])
    )


hostile_bodies = route_and_body(hostile=True)
clean_bodies = route_and_body(hostile=False)

# ---------------------------------------------------------------------------------------
# Mutations


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a body a value sits at (not the root)."""
    out = []
    if isinstance(value, dict) and not isinstance(value, Raw):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return out
    for key, child in items:
        out.append((*prefix, key))
        out += paths(child, (*prefix, key))
    return out


def replace_at(body: Any, path: tuple, new: Any) -> Any:
    """A copy of `body` with the value at `path` replaced."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(body, dict):
        return {k: replace_at(v, rest, new) if k == key else v for k, v in body.items()}
    return [replace_at(v, rest, new) if i == key else v for i, v in enumerate(body)]
