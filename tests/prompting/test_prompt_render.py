"""Message starts from one tagged render equal the per-prefix renders they replace.

The oracle is the old algorithm, kept only here: message i starts at
len(render(messages[:i])) when that render is a prefix of the whole prompt and ends on a
token boundary. Rendering every prefix is quadratic; `render_chat` must give the same ids,
starts and indexes while rendering a bounded number of templates for ordinary chats.
"""

from __future__ import annotations

import bisect
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.utils import load_tokenizer

from engine_bridge.engine_settings import CLAUDE_CODE_BILLING_HEADER, NormalizationRule
from engine_bridge.prompting import render as prompt
from engine_bridge.prompting.prefix_memo import PrefixMemo
from engine_bridge.prompting.render import normalize_messages, render_chat
from engine_bridge.types import EngineError, Message, ToolCall
from tests.conftest import DEMO_IDS

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def tokenizers(demo_root):
    return {name: load_tokenizer(demo_root / "models" / name) for name in DEMO_IDS}


def per_prefix_render(tokenizer, messages, tools=None, template_kwargs=None):
    """The old render_chat: one template run per message."""
    chat = [m.to_template() for m in messages]
    kwargs = dict(template_kwargs or {})
    text = prompt._apply_template(tokenizer, chat, tools, True, kwargs)
    tokens, ends = prompt._encode_with_offsets(tokenizer, text)
    starts, index = ([0], [0]) if chat else ([], [])
    for i in range(1, len(chat)):
        try:
            prefix = prompt._apply_template(tokenizer, chat[:i], tools, False, kwargs)
        except EngineError:
            continue
        if not text.startswith(prefix):
            continue
        t = bisect.bisect_right(ends, len(prefix))
        if t > 0 and ends[t - 1] == len(prefix) and t > starts[-1]:
            starts.append(t)
            index.append(i)
    return tokens, text, starts, index


def one_pass(tokenizer, messages, tools=None, template_kwargs=None, memo=None):
    r = render_chat(tokenizer, messages, tools, template_kwargs, memo=memo)
    return r.tokens, r.text, r.message_starts, r.message_index


class CountingTokenizer:
    """Counts template runs and the messages they rendered."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer._tokenizer
        self._wrapped = tokenizer
        self.runs = 0
        self.messages = 0

    def apply_chat_template(self, messages, **kwargs):
        self.runs += 1
        self.messages += len(messages)
        return self._wrapped.apply_chat_template(messages, **kwargs)


# -- conversations ------------------------------------------------------------------------

# Short pieces that tokenize in interesting ways: multi-byte chars, template markup, blanks,
# and the billing header the normalization rule removes.
PIECES = [
    "Hi",
    " there",
    "café",
    "日本語",
    "🎉",
    "  ",
    "\n",
    "<think>x</think>",
    "<tool_call>",
    "x-anthropic-billing-header: cc_version=2.1; cc_entrypoint=cli;\n",
    ".",
]
text = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=4).map("".join),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=8),
)
call = st.builds(
    ToolCall,
    name=st.sampled_from(["get_weather", "lookup", "naïve_fn", ""]),
    arguments=st.one_of(
        st.fixed_dictionaries({"city": text}), st.just('{"city": "Lisbon"}'), st.none()
    ),
    id=st.sampled_from(["call_1", ""]),
)
message = st.one_of(
    st.builds(Message, role=st.just("system"), content=text),
    st.builds(Message, role=st.just("user"), content=text),
    st.builds(
        Message,
        role=st.just("assistant"),
        content=text,
        reasoning=st.one_of(st.none(), text),
        tool_calls=st.one_of(st.none(), st.lists(call, max_size=2).map(tuple)),
    ),
    st.builds(Message, role=st.just("tool"), content=text, tool_call_id=st.just("call_1")),
)
conversation = st.lists(message, min_size=1, max_size=12)
tools = st.sampled_from([None, [WEATHER]])

# Conversations with no blanks and no thinking, and some text in every message: the ones the
# tagged render handles alone.
named_call = call.filter(lambda c: c.name)
plain_text = st.lists(
    st.sampled_from(["Hi", " there", "café", "🎉", ".", "\n    indented"]), min_size=1, max_size=3
)
plain_message = st.one_of(
    st.builds(Message, role=st.just("user"), content=plain_text.map("".join)),
    st.builds(
        Message,
        role=st.just("assistant"),
        content=plain_text.map("".join),
        tool_calls=st.one_of(st.none(), st.lists(named_call, max_size=2).map(tuple)),
    ),
    # A call and no text, as agents answer mid-turn.
    st.builds(
        Message,
        role=st.just("assistant"),
        tool_calls=st.lists(named_call, min_size=1, max_size=2).map(tuple),
    ),
    st.builds(
        Message, role=st.just("tool"), content=plain_text.map("".join), tool_call_id=st.just("c")
    ),
)
plain_conversation = st.lists(plain_message, min_size=1, max_size=12)

HYPOTHESIS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("model", DEMO_IDS)
@HYPOTHESIS
@given(messages=conversation, tools=tools, thinking=st.booleans())
def test_message_starts_equal_per_prefix_renders_on_demo_templates(
    tokenizers, model, messages, tools, thinking
):
    tokenizer = tokenizers[model]
    kwargs = {"enable_thinking": thinking}
    assert one_pass(tokenizer, messages, tools, kwargs) == per_prefix_render(
        tokenizer, messages, tools, kwargs
    )


@HYPOTHESIS
@given(messages=plain_conversation, tools=tools)
def test_repeating_a_plain_conversation_renders_no_more_templates(tokenizers, messages, tools):
    # Each kind of boundary is rendered once. From the third copy of a conversation on, every
    # boundary's kind (shapes either side, all roles already seen) occurred in the copy before,
    # so a fourth copy costs no template run.
    tokenizer = tokenizers["demo-llama"]
    runs = []
    for copies in (3, 4):
        counting = CountingTokenizer(tokenizer)
        longer = messages * copies
        assert one_pass(counting, longer, tools) == per_prefix_render(tokenizer, longer, tools)
        runs.append(counting.runs)
    assert runs[0] == runs[1]


def agent_session(turns: int) -> list[Message]:
    """Claude Code-like: a long system prompt, then user, tool call, result, answer."""
    out = [Message("system", "You are a coding agent. " * 50)]
    for t in range(turns):
        out += [
            Message("user", f"Fix bug {t} in the parser, please. " * 5),
            Message("assistant", "", tool_calls=(ToolCall("read_file", {"path": f"f{t}.py"}),)),
            Message("tool", f"def parse_{t}(x):\n    return x\n" * 20, tool_call_id="c"),
            Message("assistant", f"Fixed bug {t}: the parser now returns early. " * 3),
        ]
    return out


def test_two_hundred_messages_render_the_template_a_constant_number_of_times(tokenizers):
    tokenizer = tokenizers["demo-hybrid"]
    messages = agent_session(50)
    counting = CountingTokenizer(tokenizer)
    assert one_pass(counting, messages, [WEATHER]) == per_prefix_render(
        tokenizer, messages, [WEATHER]
    )
    # Two whole renders, plus one prefix per kind of boundary (message shapes either side,
    # roles seen before, and whether an assistant turn before it is the current one in the
    # prefix but a past one in the whole, which Qwen3.6's template renders differently):
    # eleven kinds, all met early, so the count does not grow with the conversation. The old
    # way rendered 199 prefixes, 19,900 messages.
    assert (counting.runs, counting.messages) == (2 + 11, 1035)


# -- across requests ---------------------------------------------------------------------


@pytest.mark.parametrize("model", DEMO_IDS)
@HYPOTHESIS
@given(
    messages=conversation,
    other=conversation,
    tools=tools,
    thinking=st.booleans(),
    data=st.data(),
)
def test_remembered_prefixes_give_the_same_starts_turn_after_turn(
    tokenizers, model, messages, other, tools, thinking, data
):
    # Turns of one conversation, then one that shares only its start with them (an edit),
    # then the conversation again with other tools: the memo never changes a start.
    tokenizer = tokenizers[model]
    kwargs = {"enable_thinking": thinking}
    memo = PrefixMemo()
    cut = data.draw(st.integers(0, len(messages)))
    edited = messages[:cut] + other
    for turn in [messages[:k] for k in range(1, len(messages) + 1)] + [edited]:
        assert one_pass(tokenizer, turn, tools, kwargs, memo) == per_prefix_render(
            tokenizer, turn, tools, kwargs
        )
    other_tools = None if tools else [WEATHER]
    assert one_pass(tokenizer, messages, other_tools, kwargs, memo) == per_prefix_render(
        tokenizer, messages, other_tools, kwargs
    )


def thinking_session(turns: int) -> list[Message]:
    """A Claude Code-like session with reasoning on every answer: the demo template drops
    reasoning before the last user turn, so no single render places those starts."""
    out = [Message("system", "You are a coding agent. " * 50)]
    for t in range(turns):
        out += [
            Message("user", f"Fix bug {t} in the parser, please. " * 5),
            Message(
                "assistant",
                "",
                f"Read f{t}.py first.",
                (ToolCall("read_file", {"path": f"f{t}.py"}),),
            ),
            Message("tool", f"def parse_{t}(x):\n    return x\n" * 20, tool_call_id="c"),
            Message("assistant", f"Fixed bug {t}. " * 3, f"The parser returns early in {t}."),
        ]
    return out


@pytest.mark.parametrize("session", [agent_session, thinking_session])
def test_next_turn_renders_only_its_new_prefixes(tokenizers, session):
    tokenizer = tokenizers["demo-hybrid"]
    memo = PrefixMemo()
    turn = [*session(40), Message("user", "Now the lexer.")]
    one_pass(tokenizer, turn, [WEATHER], memo=memo)
    # The next request of an agent: the tool call the model answered with, and its result.
    call = ToolCall("read_file", {"path": "lexer.py"})
    reasoning = "Read the lexer." if session is thinking_session else None
    nxt = [
        *turn,
        Message("assistant", "", reasoning, (call,)),
        Message("tool", "def lex(s):\n    return s.split()\n", tool_call_id="c"),
    ]
    counting = CountingTokenizer(tokenizer)
    assert one_pass(counting, nxt, [WEATHER], memo=memo) == per_prefix_render(
        tokenizer, nxt, [WEATHER]
    )
    # The whole prompt, then the tagged render or the new prefixes (demo-hybrid's Qwen3.6
    # template shows a reasoning block only for turns after the last user query, so the
    # new turn's boundaries are new kinds); never one render per message.
    assert counting.runs <= 4, counting.runs


def test_thinking_dropped_before_the_last_user_turn_leaves_those_starts_out(tokenizers):
    # The demo template drops reasoning before the last user message, so each prefix that
    # ends inside that turn renders reasoning the whole prompt lacks: no start there.
    messages = [
        Message("user", "Weather in Lisbon?"),
        Message("assistant", "", "Look it up.", (ToolCall("get_weather", {"city": "Lisbon"}),)),
        Message("tool", "19C", tool_call_id="call_1"),
        Message("assistant", "It is 19C.", "Report it."),
        Message("user", "And Porto?"),
        Message("assistant", "Checking.", "One call."),
    ]
    tokenizer = tokenizers["demo-swa"]
    result = render_chat(tokenizer, messages, [WEATHER])
    assert result.message_index == [0, 1, 5]
    assert one_pass(tokenizer, messages, [WEATHER]) == per_prefix_render(
        tokenizer, messages, [WEATHER]
    )


def test_consecutive_tool_results_share_a_turn_so_the_second_has_no_start(tokenizers):
    messages = [
        Message("user", "Porto and Faro?"),
        Message("assistant", "", tool_calls=(ToolCall("get_weather", {"city": "Porto"}),)),
        Message("tool", "17C", tool_call_id="a"),
        Message("tool", "24C", tool_call_id="b"),
        Message("assistant", "17C and 24C."),
    ]
    result = render_chat(tokenizers["demo-llama"], messages, [WEATHER])
    assert result.message_index == [0, 1, 2, 4]


# -- templates that rewrite history in other ways -------------------------------------------

QWEN3 = """\
{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}\
{{- messages[0].content + '\\n\\n' }}{%- endif %}{{- '# Tools\\n<tools>' }}\
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}\
{{- '\\n</tools><|im_end|>\\n' }}{%- else %}{%- if messages[0].role == 'system' %}\
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}\
{%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}{%- set ns.multi_step_tool = false %}\
{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}{%- if message.content is string %}\
{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}\
{%- if (message.role == "user") or (message.role == "system" and not loop.first) %}\
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\
{%- elif message.role == "assistant" %}{%- set reasoning_content = '' %}\
{%- if message.reasoning_content is string %}\
{%- set reasoning_content = message.reasoning_content %}{%- else %}\
{%- if '</think>' in content %}{%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}\
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}\
{%- if loop.index0 > ns.last_query_index %}\
{%- if loop.last or (not loop.last and reasoning_content) %}\
{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}{%- else %}\
{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{%- else %}\
{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}\
{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}\
{%- if (loop.first and content) or (not loop.first) %}{{- '\\n' }}{%- endif %}\
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}\
{{- '<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}\
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}\
{{- tool_call.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}\
{%- endif %}{{- '<|im_end|>\\n' }}{%- elif message.role == "tool" %}\
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}\
{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}{{- content }}\
{{- '\\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\
{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}\
{%- if enable_thinking is defined and enable_thinking is false %}\
{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""

# The system prompt rides on the last user message (as some Mistral templates do).
SYSTEM_ON_LAST_USER = """\
{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}\
{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}\
{%- if m.role == 'system' -%}{%- elif m.role == 'user' -%}[INST] \
{%- if loop.index0 == ns.last and messages[0].role == 'system' %}{{ messages[0].content }}

{% endif -%}{{ m.content }}[/INST]{%- else -%}{{ m.role }}: {{ m.content }}</s>{%- endif -%}\
{%- endfor -%}"""

# Tool results before the last user message are elided.
ELIDE_OLD_RESULTS = """\
{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}\
{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}\
<|{{ m.role }}|>{%- if m.role == 'tool' and loop.index0 < ns.last -%}[elided]\
{%- else -%}{{ m.content }}{%- endif -%}{%- for c in m.tool_calls or [] -%}\
<call>{{ c.function.name }}</call>{%- endfor -%}<|end|>
{% endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""

# Older answers are marked, so no prefix matches the whole prompt past them.
MARK_OLD_ANSWERS = """\
{%- set ns = namespace(last=-1) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}\
{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}{%- for m in messages -%}\
<{{ m.role }}>{%- if m.role == 'assistant' and loop.index0 < ns.last -%}(old) {% endif -%}\
{{ m.content }}</{{ m.role }}>{%- endfor -%}"""

# The length of every content, and of the conversation: tags change both.
COUNTS = """\
{{ messages|length }} messages
{% for m in messages -%}<{{ m.role }} n={{ m.content|length }}>{{ m.content }}{%- endfor -%}"""

OTHER_TEMPLATES = {
    "qwen3": QWEN3,
    "system_on_last_user": SYSTEM_ON_LAST_USER,
    "elide_old_results": ELIDE_OLD_RESULTS,
    "mark_old_answers": MARK_OLD_ANSWERS,
    "counts": COUNTS,
}


@pytest.mark.parametrize("name", OTHER_TEMPLATES)
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=st.one_of(conversation, plain_conversation), tools=tools)
def test_message_starts_equal_per_prefix_renders_on_templates_that_rewrite_history(
    tokenizers, name, messages, tools
):
    tokenizer = tokenizers["demo-llama"]
    kwargs = {"chat_template": OTHER_TEMPLATES[name]}
    try:
        expected = per_prefix_render(tokenizer, messages, tools, kwargs)
    except EngineError:  # e.g. Qwen3 without a user message
        with pytest.raises(EngineError):
            one_pass(tokenizer, messages, tools, kwargs)
        return
    assert one_pass(tokenizer, messages, tools, kwargs) == expected


def test_text_with_a_tag_character_is_rendered_prefix_by_prefix(tokenizers, caplog):
    messages = [Message("user", "odd \ufdd0 char"), Message("assistant", "ok")]
    tokenizer = tokenizers["demo-llama"]
    with caplog.at_level("DEBUG", logger="engine_bridge.prompting.render"):
        assert one_pass(tokenizer, messages) == per_prefix_render(tokenizer, messages)
    assert "tag character" in caplog.text


def test_a_template_that_measures_content_is_rendered_prefix_by_prefix(tokenizers, caplog):
    messages = [Message("user", "Hi"), Message("assistant", "Hello"), Message("user", "Bye")]
    tokenizer = tokenizers["demo-llama"]
    kwargs = {"chat_template": COUNTS}
    with caplog.at_level("DEBUG", logger="engine_bridge.prompting.render"):
        assert one_pass(tokenizer, messages, None, kwargs) == per_prefix_render(
            tokenizer, messages, None, kwargs
        )
    assert "tags change what the template renders" in caplog.text


# -- normalization --------------------------------------------------------------------------


def test_billing_header_is_removed_from_system_messages_only():
    header = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch=ab12;\n"
    messages = [Message("system", header + "You are Claude Code."), Message("user", header)]
    out = normalize_messages(messages, [CLAUDE_CODE_BILLING_HEADER])
    assert out == [Message("system", "You are Claude Code."), messages[1]]
    assert out[1] is messages[1]


def test_rules_apply_to_the_roles_they_name():
    rule = NormalizationRule("date", re.compile(r"Today is \S+\."), "", roles=("user",))
    messages = [Message("system", "Today is Monday."), Message("user", "Today is Monday. Hi")]
    assert normalize_messages(messages, [rule]) == [messages[0], Message("user", " Hi")]
