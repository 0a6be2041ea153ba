"""Split a model's output text into reasoning, answer text and tool calls, in its own format.

The format is the loaded tokenizer's, as mlx-lm infers it: the reasoning markers
(`think_start`/`think_end`), the tool-call markers and the parser module of the family
(`tool_call_start`/`tool_call_end`, `tool_parser`: Hermes JSON, Qwen3.5/3.6 XML, Gemma 4,
GLM, Mistral, Kimi, MiniMax, pythonic, ...). mlx-lm's own `TextStateMachine` finds the
markers in the streamed text and strips them; its parser reads each call. The one family
mlx-lm 0.32.2 has nothing for, gpt-oss's harmony channels, is mapped here (`harmony.py`).
A call the model wrote in another family's markup is read by that family's parser
(`foreign_calls.py`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine

from ..types import Part, ToolCall, new_call_id
from . import foreign_calls, harmony

log = logging.getLogger("engine_bridge.prompting.output_format")


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What a model's tokenizer says about the markup in its output."""

    think_start: str | None = None
    think_end: str | None = None
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    # mlx-lm's parse_tool_call(text, tools) of the family; None without tool calling.
    tool_parser: Callable[[str, Any], Any] | None = field(default=None, compare=False)
    # The parser module's name (json_tools, qwen3_coder, gemma4, ...) or "harmony".
    family: str | None = None
    # Strings stripped wherever they appear (mlx-lm's structural markers).
    markers: tuple[str, ...] = ()
    # A response format's own states and edges (mlx-lm's `response_transitions`, from a
    # chat_template_type module: Muse Spark's message headers), and the state an answer
    # starts in. Text in a state other than normal, reasoning and tool is dropped.
    response: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    response_initial: str | None = None
    # The model's id, for the log lines about its output.
    model: str = field(default="", compare=False)

    @classmethod
    def of(cls, tokenizer: Any, model: str = "") -> OutputFormat:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        if harmony.is_harmony_vocab(vocab):
            return cls(family="harmony")
        parser = getattr(tokenizer, "tool_parser", None)
        start = getattr(tokenizer, "tool_call_start", None)
        family = None
        if parser is not None:
            family = getattr(parser, "__module__", "").rsplit(".", 1)[-1] or None
        return cls(
            think_start=getattr(tokenizer, "think_start", None),
            think_end=getattr(tokenizer, "think_end", None),
            tool_call_start=start if parser is not None else None,
            tool_call_end=getattr(tokenizer, "tool_call_end", None) if parser else None,
            tool_parser=parser,
            family=family,
            markers=tuple(getattr(tokenizer, "structural_markers", ()) or ()),
            response=tuple(
                (state, tuple((marker, dst) for marker, dst in edges))
                for state, edges in (getattr(tokenizer, "response_transitions", None) or {}).items()
            ),
            response_initial=getattr(tokenizer, "response_initial_state", None),
            model=model,
        )

    @property
    def harmony(self) -> bool:
        return self.family == "harmony"

    @property
    def routed(self) -> bool:
        """A response format that enters "tool" itself says where calls start (mlx-lm's rule)."""
        return any(dst == "tool" for _, edges in self.response for _, dst in edges)

    def foreign(self) -> dict[str, tuple[str, str]]:
        """Other families' call regions the answer text is watched for, by state (a model
        with a parser of its own, whose format does not route calls itself)."""
        if self.tool_parser is None or self.harmony or self.routed:
            return {}
        own = (self.tool_call_start, self.tool_call_end, self.think_start, self.think_end)
        return foreign_calls.regions(own + self.markers)

    def opens_in_reasoning(self, prompt_text: str) -> bool:
        """The prompt ends inside an open reasoning block (a template that prefills it)."""
        if self.harmony or not self.think_start:
            return False
        return prompt_text.rfind(self.think_start) > prompt_text.rfind(self.think_end or "\0")

    def machine(self, tools: bool) -> TextStateMachine:
        """The markers as mlx-lm's state machine sees them (mlx_lm.generate's transitions,
        with the tool edges only when the request offers tools)."""
        if self.harmony:
            return TextStateMachine(harmony.TRANSITIONS)
        transitions: dict[str, list[tuple[str, str]]] = {}
        if self.think_start and self.think_end:
            transitions["normal"] = [(self.think_start, "reasoning")]
            transitions["reasoning"] = [(self.think_end, "normal")]
        routed = self.routed
        if (tools or routed) and self.tool_call_start:
            if not routed:
                transitions.setdefault("normal", []).append((self.tool_call_start, "tool"))
            if "reasoning" in transitions:
                transitions["reasoning"].append((self.tool_call_start, "tool"))
            transitions["tool"] = [(self.tool_call_end, "normal")] if self.tool_call_end else []
        for state, (start, end) in (self.foreign() if tools else {}).items():
            # Only from answer text: reasoning that mentions a tag is the model thinking.
            transitions.setdefault("normal", []).append((start, state))
            transitions[state] = [(end, "normal")]
        for marker in self.markers:
            transitions.setdefault("normal", []).append((marker, "normal"))
        for state, edges in self.response:
            transitions.setdefault(state, []).extend(edges)
        return TextStateMachine(transitions or None)

    def parser(
        self,
        *,
        prompt_text: str = "",
        tools: list[dict[str, Any]] | None = None,
        raw: bool = False,
        parallel: bool = True,
    ) -> OutputParser:
        initial = "normal"
        if self.harmony:
            initial = harmony.initial_state(prompt_text)
        elif self.response_initial:
            initial = self.response_initial
        elif self.opens_in_reasoning(prompt_text):
            initial = "reasoning"
        return OutputParser(self, initial, tools=tools, raw=raw, parallel=parallel)


# Newlines right after a closing marker are layout, not answer text; they may arrive in a
# later chunk than the marker.
_LAYOUT = "\n"


class OutputParser:
    """Incremental: feed text chunks, get parts; `finish` flushes what is held back."""

    def __init__(
        self,
        fmt: OutputFormat,
        initial: str = "normal",
        *,
        tools: list[dict[str, Any]] | None = None,
        raw: bool = False,
        parallel: bool = True,
    ):
        self._fmt = fmt
        self._tools = tools
        self._raw = raw  # plain completions: the text exactly as generated
        self._parallel = parallel
        self._calls = 0
        self._sm = fmt.machine(bool(tools)).make_state(initial)
        self._foreign = fmt.foreign() if tools else {}
        self._state = initial
        self._tool_text = ""
        self._strip = False
        # Newlines ending the answer text so far: layout if a call comes next (templates
        # put their own before a call), text otherwise. Held so a re-rendered history
        # matches what the model wrote, and the next turn's cache hit reaches past it.
        self._held = ""
        self._before_call = ""
        self._harmony = harmony.Channels(bool(tools)) if fmt.harmony else None

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def _in_call(self) -> bool:
        return self._state == "tool" or self._state in self._foreign

    @property
    def in_reasoning(self) -> bool:
        """Inside the reasoning block (harmony: an analysis message's body)."""
        if self._harmony is not None:
            return self._harmony.in_reasoning
        return self._state == "reasoning"

    def feed(self, chunk: str) -> list[Part]:
        if self._raw:
            return [Part("text", chunk)] if chunk else []
        if not chunk:
            return []
        self._sm, segments = TextStateMachine.split(self._sm, chunk)
        return self._take(segments)

    def finish(self, finish_reason: str = "stop") -> list[Part]:
        """The rest, at the end of generation (`length` when max_tokens cut it off)."""
        if self._raw:
            return []
        self._sm, tail, state = TextStateMachine.flush(self._sm)
        parts = self._take([(state, tail)]) if tail else []
        if self._in_call or (self._harmony and self._harmony.in_call):
            # A call the output ended inside: complete when the family ends calls with the
            # output (Mistral, harmony's <|call|>), cut off when max_tokens ended it.
            parts += self._end_call(cut_off=finish_reason == "length", closed=False)
        if self._held:
            parts.append(Part("text", self._held))
            self._held = ""
        return parts

    def _take(self, segments: list[tuple[str | None, str]]) -> list[Part]:
        parts: list[Part] = []
        for i, (state, text) in enumerate(segments):
            if i > 0:  # a marker closed the span before this one
                parts += self._close(self._state)
                self._state = state or "normal"
                if self._in_call:
                    self._before_call, self._held = self._held, ""
                elif self._held:
                    parts.append(Part("text", self._held))
                    self._held = ""
            if self._harmony is not None:
                parts += self._harmony_text(self._state, text)
                continue
            if self._in_call:
                self._tool_text += text
                continue
            if self._state not in ("normal", "reasoning"):
                continue  # a response format's own state (a message header): not output
            if self._strip:
                text = text.lstrip(_LAYOUT)
                if not text:
                    continue
                self._strip = False
            if self._state != "reasoning":
                text = self._held + text
                body = text.rstrip(_LAYOUT)
                self._held = text[len(body) :]
                text = body
            if text:
                parts.append(Part("reasoning" if self._state == "reasoning" else "text", text))
        return parts

    def _close(self, state: str) -> list[Part]:
        if self._harmony is not None:
            return self._harmony_close(state)
        if state == "tool" or state in self._foreign:
            return self._end_call(cut_off=False, closed=True)
        if state == "reasoning":
            self._strip = True
        return []

    def _end_call(self, cut_off: bool, closed: bool) -> list[Part]:
        own = True
        if self._harmony is not None:
            name, body = self._harmony.take_call()
            markup = body
            calls = None if cut_off else _harmony_call(name, body)
        else:
            body, self._tool_text = self._tool_text, ""
            own = self._state == "tool"
            markers = self._foreign.get(
                self._state, (self._fmt.tool_call_start or "", self._fmt.tool_call_end or "")
            )
            self._state = "normal"
            markup = markers[0] + body + (markers[1] if closed else "")
            calls = None if cut_off else self._parse(body, markers, own=own, closed=closed)
        # Another family's tags that held no call are text the model wrote, layout and all.
        self._strip = own or calls is not None
        if calls is not None:
            self._before_call = ""
        if calls is None:
            why = "cut off by max_tokens" if cut_off else "rejected by the parser"
            log.log(
                logging.WARNING if own else logging.DEBUG,
                "a %s tool call was %s; it is returned as text (%d chars)",
                self._fmt.family if own else markers[0],
                why,
                len(markup),
            )
            markup = self._before_call + markup
            self._before_call = ""
            return [Part("text", markup)] if markup else []
        parts = []
        for call in calls:
            if not self._parallel and self._calls >= 1:
                log.info("dropped tool call %r: parallel tool calls are off", call.name)
                continue
            self._calls += 1
            parts.append(Part("tool_call", call=call))
        return parts

    def _parse(
        self, body: str, markers: tuple[str, str], *, own: bool, closed: bool
    ) -> list[ToolCall] | None:
        """The model's own parser's calls; where it finds none that names a tool of the
        request, another family's parser may read a closed region (foreign_calls.py)."""
        calls = self._parse_own(body) if own else None
        tools = self._tools
        if not closed or not tools:
            return calls
        if calls and {c.name for c in calls} <= foreign_calls.tool_names(tools):
            return calls
        found = foreign_calls.read(body, markers, self._fmt.tool_parser, tools)
        if found is None:
            return calls
        foreign_calls.warn_once(self._fmt.model, self._fmt.family, found.family)
        read = [_tool_call(item, tools) for item in found.calls]
        assert None not in read, (found.family, found.calls)  # read() checked each one
        return read

    def _parse_own(self, body: str) -> list[ToolCall] | None:
        parser = self._fmt.tool_parser
        assert parser is not None, "a tool span without a parser"
        try:
            parsed = parser(body, self._tools)
        except Exception as e:  # each family's parser raises its own errors on bad text
            log.debug("tool parser %s: %s: %s", self._fmt.family, type(e).__name__, e)
            return None
        calls = []
        for item in parsed if isinstance(parsed, list) else [parsed]:
            call = _tool_call(item, self._tools)
            if call is None:
                return None
            calls.append(call)
        return calls or None

    # -- harmony -----------------------------------------------------------------------------

    def _harmony_text(self, state: str, text: str) -> list[Part]:
        assert self._harmony is not None
        kind = self._harmony.feed(state, text)
        if kind is None or not text:
            return []
        return [Part(kind, text)]

    def _harmony_close(self, state: str) -> list[Part]:
        assert self._harmony is not None
        if state == "body" and self._harmony.in_call:
            return self._end_call(cut_off=False, closed=True)
        self._harmony.close(state)
        return []


def _tool_call(item: Any, tools: list[dict[str, Any]] | None) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    args = item.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    args = typed_arguments(args, _schema(item["name"], tools))
    call_id = item.get("id")
    return ToolCall(
        item["name"], args, call_id if isinstance(call_id, str) and call_id else new_call_id()
    )


def _harmony_call(name: str, body: str) -> list[ToolCall] | None:
    try:
        args = json.loads(body) if body.strip() else {}
    except ValueError:
        return None
    if not name or not isinstance(args, dict):
        return None
    return [ToolCall(name, args, new_call_id())]


def _schema(name: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            if isinstance(params, dict) and isinstance(params.get("properties"), dict):
                return params["properties"]
    return {}


def typed_arguments(args: dict[str, Any], properties: dict[str, Any]) -> dict[str, Any]:
    """Arguments as the tool's schema types them: families that write every value as text
    (GLM, Gemma 4, some XML forms) give "30" for an integer; the client expects 30."""
    out = dict(args)
    for key, value in args.items():
        spec = properties.get(key)
        if isinstance(value, str) and isinstance(spec, dict):
            out[key] = _typed(value, spec.get("type"))
    return out


def _typed(value: str, kind: Any) -> Any:
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds:
        return value
    text = value.strip()
    for k in kinds:
        try:
            if k == "integer":
                number = float(text)
                if number.is_integer():
                    return int(number)
            elif k == "number":
                number = float(text)
                return int(number) if number.is_integer() and "." not in text else number
            elif k == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            elif k in ("object", "array"):
                parsed = json.loads(text)
                if isinstance(parsed, dict if k == "object" else list):
                    return parsed
            elif k == "null" and text.lower() in ("null", "none"):
                return None
        except ValueError:
            continue
    return value
