"""How each family writes its tool calls, from {"name": ..., "arguments": {...}} dicts:
the markup the test models are forced to emit (families.py), as the real models write it."""

from __future__ import annotations

import json
from typing import Any


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(value: Any) -> str:
    """A value as the XML-ish formats write it: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else _json(value)


def hermes(calls):
    return "\n".join(f"<tool_call>{_json(c)}</tool_call>" for c in calls)


def qwen3_xml(calls):
    def one(c):
        params = "".join(
            f"<parameter={k}>\n{_text(v)}\n</parameter>\n" for k, v in c["arguments"].items()
        )
        return f"<tool_call>\n<function={c['name']}>\n{params}</function>\n</tool_call>"

    return "\n".join(one(c) for c in calls)


def glm47(calls):
    def one(c):
        args = "".join(
            f"<arg_key>{k}</arg_key><arg_value>{_text(v)}</arg_value>"
            for k, v in c["arguments"].items()
        )
        return f"<tool_call>{c['name']}{args}</tool_call>"

    return "".join(one(c) for c in calls)


def glm46(calls):
    """GLM-4.5/4.6: each call, and each argument tag, on a line of its own."""

    def one(c):
        args = "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{_text(v)}</arg_value>\n"
            for k, v in c["arguments"].items()
        )
        return f"\n<tool_call>{c['name']}\n{args}</tool_call>"

    return "".join(one(c) for c in calls)


def _gemma_value(value: Any) -> str:
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, bool):
        return "true" if value else "false"
    return _json(value)


def gemma4(calls):
    def one(c):
        args = ",".join(f"{k}:{_gemma_value(v)}" for k, v in c["arguments"].items())
        return f"<|tool_call>call:{c['name']}{{{args}}}<tool_call|>"

    return "".join(one(c) for c in calls)


def kimi_k2(calls):
    body = "".join(
        f"<|tool_call_begin|>functions.{c['name']}:{i}<|tool_call_argument_begin|>"
        f"{_json(c['arguments'])}<|tool_call_end|>"
        for i, c in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def minimax_m2(calls):
    def one(c):
        params = "".join(
            f'<parameter name="{k}">{_text(v)}</parameter>\n' for k, v in c["arguments"].items()
        )
        return f'<invoke name="{c["name"]}">\n{params}</invoke>\n'

    return "<minimax:tool_call>\n" + "".join(one(c) for c in calls) + "</minimax:tool_call>"


def mistral(calls):
    return "".join(f"[TOOL_CALLS]{c['name']}[ARGS]{_json(c['arguments'])}" for c in calls)


# Mistral Small 3.2 writes a call id of 9 letters and digits; its template rejects others.
MISTRAL_CALL_IDS = ("a1B2c3D4e", "f5G6h7J8k")


def mistral_call_ids(calls):
    return "".join(
        f"[TOOL_CALLS]{c['name']}[CALL_ID]{i}[ARGS]{_json(c['arguments'])}"
        for c, i in zip(calls, MISTRAL_CALL_IDS, strict=False)
    )


def pythonic(calls):
    def one(c):
        return f"{c['name']}({', '.join(f'{k}={_json(v)}' for k, v in c['arguments'].items())})"

    return f"<|tool_call_start|>[{', '.join(one(c) for c in calls)}]<|tool_call_end|>"


def function_gemma(calls):
    def value(v):
        return f"<escape>{v}<escape>" if isinstance(v, str) else _json(v)

    def one(c):
        args = ",".join(f"{k}:{value(v)}" for k, v in c["arguments"].items())
        return f"<start_function_call>call:{c['name']}{{{args}}}<end_function_call>"

    return "".join(one(c) for c in calls)


def longcat(calls):
    def one(c):
        args = "".join(
            f"<longcat_arg_key>{k}</longcat_arg_key>\n"
            f"<longcat_arg_value>{_text(v)}</longcat_arg_value>\n"
            for k, v in c["arguments"].items()
        )
        return f"<longcat_tool_call>{c['name']}\n{args}</longcat_tool_call>"

    return "\n".join(one(c) for c in calls)


def minicpm5(calls):
    def one(c):
        params = "".join(f'<param name="{k}">{_text(v)}</param>' for k, v in c["arguments"].items())
        return f'<function name="{c["name"]}">{params}</function>'

    return "".join(one(c) for c in calls)


def kimi_k3(calls):
    def arg(k, v):
        # The parser keeps a "string" as written and reads any other type as JSON.
        kind = "string" if isinstance(v, str) else "integer" if isinstance(v, int) else "object"
        return f'<|open|>argument key="{k}" type="{kind}"<|sep|>{_text(v)}<|close|>argument<|sep|>'

    body = "".join(
        f'<|open|>call tool="{c["name"]}" index="{i}"<|sep|>'
        + "".join(arg(k, v) for k, v in c["arguments"].items())
        + "<|close|>call<|sep|>"
        for i, c in enumerate(calls, 1)
    )
    # The tools section, then the end of the assistant message (a structural marker).
    return f"<|open|>tools<|sep|>{body}<|close|>tools<|sep|><|close|>message<|sep|>"


def harmony(calls):
    (call,) = calls
    args = json.dumps(call["arguments"], ensure_ascii=False, separators=(",", ":"))
    return (
        f"<|start|>assistant<|channel|>commentary to=functions.{call['name']} "
        f"<|constrain|>json<|message|>{args}<|call|>"
    )
