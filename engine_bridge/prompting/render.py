"""Request → token ids, plus where each message starts in tokens, plus client-noise rules.

Message starts matter to the cache: snapshot models (SSM, sliding window) can only resume
where a checkpoint was taken, and the start of a message is where the next turn of the
same conversation is most likely to diverge from the last one.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..engine_settings import NormalizationRule
from ..types import EngineError, Message
from .prefix_memo import RAISED, PrefixDigests, PrefixMemo, prefix_keys, text_digest

if TYPE_CHECKING:
    from .images import VisionPrompt

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RenderedPrompt:
    tokens: list[int]
    text: str
    # Token index where message i starts, for the messages whose start falls on a token
    # boundary of the full prompt (templates that rewrite history leave gaps).
    message_starts: list[int] = field(default_factory=list)
    # Which message each entry of message_starts belongs to.
    message_index: list[int] = field(default_factory=list)
    # Real ids, images and positions when the prompt has images; `tokens` then holds the
    # ids the cache keys on (vision/prompt.py).
    vision: VisionPrompt | None = None
    # Token index where the generation prompt opens a reasoning block (Qwen3.6's `<think>`),
    # or None. Templates that open one drop it from the turn when it is history, so the next
    # turn leaves this prompt right there: a snapshot model needs a checkpoint at this token.
    reply_opens_at: int | None = None
    # Token index where a closing user message's text starts when the message has no start
    # of its own (a template that rewrote the history before it): a checkpoint goes there.
    question_at: int | None = None
    # The message starts of tool results: no save points (`resume_points`).
    tool_starts: frozenset[int] = frozenset()

    @property
    def resume_points(self) -> list[int]:
        """Where a snapshot model checkpoints as prefill passes: message starts, the
        closing question's text, where the generation prompt opens reasoning.

        Not where a tool result starts. It follows the call that asked for it with nothing
        between, so the turn that sent the call left a save point just before (the call's
        own message start, or that turn's prompt end, where its reply opened), and each
        point costs a prefill pass of its own (on a split model, a round of collectives)
        and a checkpoint's RAM. Only an edit of the result itself resumes the shorter way,
        and it then computes the call again: one assistant message."""
        extra = [p for p in (self.question_at, self.reply_opens_at) if p is not None]
        return [*(p for p in self.message_starts if p not in self.tool_starts), *extra]

    def message_at(self, token_index: int) -> int | None:
        """The index of the message that contains `token_index`, if known."""
        i = bisect.bisect_right(self.message_starts, token_index) - 1
        return self.message_index[i] if i >= 0 else None


def normalize_messages(
    messages: Sequence[Message], rules: Sequence[NormalizationRule]
) -> list[Message]:
    """Apply the rules to the contents of the roles they name."""
    out = []
    for message in messages:
        content, parts = message.content, message.parts
        for rule in rules:
            if message.role in rule.roles:
                content = rule.pattern.sub(rule.replacement, content)
                if parts is not None:  # the text between images is what the template renders
                    parts = tuple(
                        rule.pattern.sub(rule.replacement, p) if isinstance(p, str) else p
                        for p in parts
                    )
        if content == message.content and parts == message.parts:
            out.append(message)
        else:
            out.append(replace(message, content=content, parts=parts))
    return out


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    rules: Sequence[NormalizationRule] = (),
    memo: PrefixMemo | None = None,
) -> RenderedPrompt:
    """Render with the model's chat template and find each message's first token.

    With a `memo` (one per model), prefixes rendered for an earlier request are not rendered
    again: a conversation's next turn renders only its new ones.
    """
    chat = [m.to_template() for m in normalize_messages(messages, rules)]
    kwargs = dict(template_kwargs or {})

    def render(part: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return _apply_template(tokenizer, part, tools, add_generation_prompt, kwargs)

    text = render(chat, True)
    tokens, ends = _encode_with_offsets(tokenizer, text)
    starts: list[int] = [0] if chat else []
    index: list[int] = [0] if chat else []
    keys = prefix_keys(chat, tools, kwargs) if memo is not None else None
    for i, length in enumerate(prefix_lengths(render, chat, text, memo, keys), start=1):
        if length is None:
            continue
        t = bisect.bisect_right(ends, length)
        if t > 0 and ends[t - 1] == length and t > starts[-1]:
            starts.append(t)
            index.append(i)
    question = _question_start(chat, text, ends, starts, index)
    opens = _reply_opens_at(tokenizer, text, ends) if chat else None
    tool = frozenset(s for s, i in zip(starts, index, strict=True)
                     if i < len(chat) and chat[i]["role"] == "tool")  # fmt: skip
    return RenderedPrompt(tokens, text, starts, index, reply_opens_at=opens,
                          question_at=question, tool_starts=tool)  # fmt: skip


def _question_start(
    chat: list[dict[str, Any]], text: str, ends: list[int], starts: list[int], index: list[int]
) -> int | None:
    """Where a closing user message's text starts, when the message itself has no start.

    A template that drops earlier reasoning renders the history before a new question
    differently without it, so the question's message has no start of its own; its text
    does, and a snapshot model needs a checkpoint there for the question asked again or
    edited to resume as far as a plain model does.
    """
    if not chat or chat[-1].get("role") != "user" or (index and index[-1] == len(chat) - 1):
        return None
    content = chat[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        return None
    char = text.rfind(content.strip())
    t = bisect.bisect_right(ends, char)
    if char < 0 or t == 0 or ends[t - 1] != char or t <= starts[-1]:
        return None
    return t


def render_plain(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    rules: Sequence[NormalizationRule] = (),
) -> RenderedPrompt:
    """The prompt's text and token ids as `render_chat` makes them, without placing message
    starts (a render per prefix, for a template that rewrites history)."""
    chat = [m.to_template() for m in normalize_messages(messages, rules)]
    text = _apply_template(tokenizer, chat, tools, True, dict(template_kwargs or {}))
    return RenderedPrompt(_encode_with_offsets(tokenizer, text)[0], text)


def _reply_opens_at(tokenizer: Any, text: str, ends: list[int]) -> int | None:
    """The token where a generation prompt that ends inside an opened reasoning block opens it."""
    think = getattr(tokenizer, "think_start", None)
    body = text.rstrip()
    if not think or not body.endswith(think):
        return None
    char = len(body) - len(think)
    t = bisect.bisect_right(ends, char)
    return t if t > 0 and ends[t - 1] == char else None


def render_completion(tokenizer: Any, prompt: str) -> RenderedPrompt:
    tokens = list(tokenizer.encode(prompt))
    return RenderedPrompt(tokens, prompt, [0], [0])


def _apply_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # jinja raises TemplateError, TypeError, … on bad messages
        raise EngineError(
            f"the model's chat template rejected the messages: {e}", field="messages"
        ) from None


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Token ids and each token's end offset in characters."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in enc["offset_mapping"]]
    # Byte-level tokens inside one multi-byte char can report ends out of order.
    for i in range(1, len(ends)):
        if ends[i] < ends[i - 1]:
            ends[i] = ends[i - 1]
    return list(enc["input_ids"]), ends


# -- where each message starts ------------------------------------------------------------
#
# Message i starts at len(render(messages[:i])) when that render is a prefix of the full
# prompt; otherwise it has no start (the template rewrote history, or a message's ending
# depends on the one after it). Rendering every prefix costs a template run per message, each
# as long as the conversation: quadratic. Instead, one more render of the whole conversation,
# with a tag at the first non-blank character of every content, reasoning and tool-call name,
# shows where each message's first field landed. What lies between a message's start and that
# field (its header), and whether the prefix matches at all, is the template's business; so
# each kind of boundary (the shapes of the messages either side, which field comes first, the
# roles seen before) is rendered for real once, at its first occurrence, which is early and
# so short, and its answer, a header or no start, is reused for the rest. That reuse assumes
# a template decides these from such local facts, as ChatML, Qwen3 and the other templates in
# tests/prompting/test_prompt_render.py do. The rest is checked, and where a check fails the prefixes
# are rendered as before:
# - the tagged render, tags removed, must be the full prompt exactly, every tag once, and
#   messages in order; else every prefix is rendered;
# - once a tagged field is missing from the full prompt (e.g. reasoning dropped before the
#   last user turn), the prefixes past that message may still show it: they are rendered;
# - a reused header must be the text right before the message's first field.

Render = Callable[[list[dict[str, Any]], bool], str]

# Unicode noncharacters: never assigned, so no client text means them; JSON keeps them as is.
_TAG_OPEN, _TAG_CLOSE = "\ufdd0", "\ufdd1"
_TAG = re.compile(f"{_TAG_OPEN}(\\d+)([a-z]\\d*){_TAG_CLOSE}")


@dataclass(slots=True)
class _Layout:
    # Per message: (offset in the full prompt, field) of its first tag there, if any.
    anchors: list[tuple[int, str] | None]
    # The first message with a field the full prompt does not show as sent, or len(messages).
    first_rewritten: int
    # Per message: the offset its start must lie past, the last anchor before it (or -1).
    floors: list[int]


def prefix_lengths(
    render: Render,
    chat: list[dict[str, Any]],
    text: str,
    memo: PrefixMemo | None = None,
    keys: Sequence[bytes] | None = None,
) -> list[int | None]:
    """For i in 1..n-1: len(render(chat[:i])) if it is a prefix of `text`, else None.

    `memo` remembers rendered prefixes across requests, under `keys[i]` for chat[:i]
    (prefix_memo.prefix_keys).
    """
    n = len(chat)
    assert memo is None or (keys is not None and len(keys) == n + 1), "memo without keys"
    digests = PrefixDigests(text)
    done: dict[int, int | None] = {}

    def exact(i: int) -> int | None:
        if i not in done:
            found = memo.get(keys[i]) if memo is not None else None
            done[i] = _render(i) if found is None else _check(*found)
        return done[i]

    def _check(length: int, digest: bytes) -> int | None:
        """A remembered prefix: its length if its text opens this prompt."""
        if (length, digest) == RAISED or length > len(text) or digests.of(length) != digest:
            return None
        return length

    def _render(i: int) -> int | None:
        try:
            prefix = render(chat[:i], False)
        except EngineError:
            if memo is not None:
                memo.put(keys[i], RAISED)
            return None
        if memo is not None:
            memo.put(keys[i], (len(prefix), text_digest(prefix)))
        return len(prefix) if text.startswith(prefix) else None

    if memo is not None:
        # What earlier requests rendered costs a digest here. A next turn adds a prefix or
        # two: rendering those beats the tagged render of the whole conversation, unless the
        # template keeps history as sent (no remembered prefix fell out of this prompt), where
        # the tagged render places every new start at once.
        missing = {i for i in range(1, n) if keys[i] not in memo}
        rewrites = any(exact(i) is None for i in range(1, n) if i not in missing)
        if len(missing) <= 1 or (len(missing) <= 2 and rewrites):
            return [exact(i) for i in range(1, n)]
    layout = _layout(render, chat, text) if n > 1 else None
    if layout is None:
        return [exact(i) for i in range(1, n)]
    # Kind of boundary -> its header; None: no start; an int: the message that showed neither.
    learned: dict[tuple, str | int | None] = {}
    out: list[int | None] = []
    guessed = 0
    # Roles before the previous message: templates branch on whether a user turn came yet.
    seen: frozenset = frozenset()
    past = _past_turn_boundaries(chat)
    for i in range(1, n):
        seen = seen | {chat[i - 2].get("role")} if i > 1 else seen
        anchor = layout.anchors[i]
        if i > layout.first_rewritten or anchor is None:
            out.append(exact(i))
            continue
        at, first_field = anchor
        kind = (seen, _shape(chat[i - 1]), _shape(chat[i]), first_field, past[i])
        if kind not in learned:
            length = exact(i)
            out.append(length)
            # A prefix reaching past the message's own first field leaves no header to reuse.
            learned[kind] = None if length is None else text[length:at] if length <= at else i
            continue
        header = learned[kind]
        if header is None:
            out.append(None)
            guessed += 1
        elif (
            isinstance(header, str)
            and at - len(header) > layout.floors[i]
            and text.startswith(header, at - len(header))
        ):
            out.append(at - len(header))
            guessed += 1
        else:
            out.append(exact(i))
    if guessed + len(learned) < n - 1:
        log.debug(
            "message starts: rendered %d of %d prefixes (history rewritten at message %d)",
            n - 1 - guessed,
            n - 1,
            layout.first_rewritten,
        )
    return out


def _past_turn_boundaries(chat: list[dict[str, Any]]) -> list[bool]:
    """Per message i: an assistant message lies between the last user message before i and
    i, and a user message comes at or after i. Qwen3-style templates render such an
    assistant as the current turn in the prefix chat[:i] and as a past turn in the whole."""
    n = len(chat)
    later_user = [False] * (n + 1)
    for i in range(n - 1, -1, -1):
        later_user[i] = later_user[i + 1] or chat[i].get("role") == "user"
    out, assistant_since_user = [], False
    for i in range(n):
        out.append(assistant_since_user and later_user[i])
        role = chat[i].get("role")
        if role == "user":
            assistant_since_user = False
        elif role == "assistant":
            assistant_since_user = True
    return out


def _layout(render: Render, chat: list[dict[str, Any]], text: str) -> _Layout | None:
    """Where each message's first field lands in `text`, from one tagged render."""
    if _TAG_OPEN in text:
        log.debug("message starts: the prompt contains a tag character; rendering each prefix")
        return None
    first_rewritten = len(chat)
    tagged: list[dict[str, Any]] = []
    sent: list[dict[str, str]] = []  # per message: tagged field -> its leading blanks
    for i, message in enumerate(chat):
        copy, fields, complete = _tag_message(message, i)
        tagged.append(copy)
        sent.append(fields)
        if not complete:
            first_rewritten = min(first_rewritten, i)
    try:
        rendered = render(tagged, True)
    except EngineError:
        return None
    pieces, found, pos, removed = [], {}, 0, 0
    for m in _TAG.finditer(rendered):
        pieces.append(rendered[pos : m.start()])
        key = (int(m[1]), m[2])
        if key in found:
            log.debug("message starts: the template repeats a field; rendering each prefix")
            return None
        found[key] = m.start() - removed
        removed += m.end() - m.start()
        pos = m.end()
    pieces.append(rendered[pos:])
    if "".join(pieces) != text:
        log.debug("message starts: tags change what the template renders; rendering each prefix")
        return None
    anchors: list[tuple[int, str] | None] = []
    floors: list[int] = []
    last = -1
    for i, fields in enumerate(sent):
        floors.append(last)
        # A field starts at its leading blanks where the prompt kept them, so that the header
        # before it does not depend on how the text begins.
        shown = [
            (at - len(blank) if text[max(0, at - len(blank)) : at] == blank else at, f)
            for f, blank in fields.items()
            if (at := found.get((i, f))) is not None
        ]
        if len(shown) < len(fields):
            first_rewritten = min(first_rewritten, i)
        anchor = min(shown) if shown else None
        if anchor is not None:
            if anchor[0] <= last:
                log.debug("message starts: the template reorders messages; rendering each prefix")
                return None
            last = anchor[0]
        anchors.append(anchor)
    return _Layout(anchors, first_rewritten, floors)


def _tag_message(message: dict[str, Any], i: int) -> tuple[dict[str, Any], dict[str, str], bool]:
    """A copy with each text field tagged at its first non-blank character, the fields tagged
    with their leading blanks, and False if a non-empty field has no such character."""
    copy = dict(message)
    fields: dict[str, str] = {}
    complete = True

    def tag(value: Any, name: str, empty_shows_nothing: bool = True) -> Any:
        nonlocal complete
        if value is None or (value == "" and empty_shows_nothing):
            return value
        if not isinstance(value, str) or not value.strip():
            complete = False
            return value
        k = len(value) - len(value.lstrip())
        fields[name] = value[:k]
        return f"{value[:k]}{_TAG_OPEN}{i}{name}{_TAG_CLOSE}{value[k:]}"

    if "content" in message:
        copy["content"] = tag(message["content"], "c")
    if "reasoning_content" in message:
        copy["reasoning_content"] = tag(message["reasoning_content"], "r")
    if message.get("tool_calls"):
        copy["tool_calls"] = [
            {
                **call,
                "function": {
                    **call["function"],
                    "name": tag(call["function"]["name"], f"n{j}", False),
                },
            }
            for j, call in enumerate(message["tool_calls"])
        ]
    return copy, fields, complete


def _shape(message: dict[str, Any]) -> tuple:
    """What a template may branch on, short of the text: the role and which fields are set."""
    return (message.get("role"), tuple((k, bool(v)) for k, v in message.items()))
