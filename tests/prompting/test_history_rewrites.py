"""What the engine does about templates that rewrite history, on the real templates:
`preserve_thinking` on where the template reads it, reasoning a client dropped put back,
and the prefix every next question shares, which warming ahead prefills."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer_dir

from engine_bridge.models.demo import families, real_templates
from engine_bridge.prompting import template_flags
from engine_bridge.prompting.next_turn import PLACEHOLDERS, next_question_prefix, read_reply
from engine_bridge.prompting.output_format import OutputFormat
from engine_bridge.prompting.reasoning_memo import ReasoningMemo, turn_digest
from engine_bridge.prompting.render import render_chat
from engine_bridge.types import Message, ToolCall

TEMPLATES = real_templates.templates_dir()
needs_templates = pytest.mark.skipif(
    not TEMPLATES.is_dir(), reason=f"the real templates are not in {TEMPLATES}"
)

CALL = ToolCall("Read", {"file_path": "README.md", "limit": 20}, "call_1")
TASK = [
    Message("system", "You are a coding agent."),
    Message("user", "Read the README."),
    Message("assistant", "", reasoning="I read it first.", tool_calls=(CALL,)),
    Message("tool", "# Title\nSome words.", tool_call_id="call_1"),
]
ANSWER = Message("assistant", "It has a title.", reasoning="The file is short.")


@needs_templates
@pytest.mark.parametrize(
    ("template", "defaults"),
    [
        ("qwen3_6.jinja", {"preserve_thinking": True}),
        ("qwen3_5.jinja", {}),
        ("glm_4_7_flash.jinja", {}),
        ("minimax_m2.jinja", {}),
        ("gpt_oss_harmony.jinja", {}),
        ("gemma4_31b_it.jinja", {}),
    ],
)
def test_preserve_thinking_is_on_only_where_the_template_reads_it(template, defaults):
    source = (TEMPLATES / template).read_text(encoding="utf-8")
    assert template_flags.default_kwargs(source) == defaults


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Tokenizers of family models on the real Qwen3.6 and Qwen3.5 templates."""
    if not TEMPLATES.is_dir():
        pytest.skip(f"the real templates are not in {TEMPLATES}")
    out = {}
    for name in ("qwen3_6.jinja", "qwen3_5.jinja"):
        path = families.write_family_model(
            tmp_path_factory.mktemp(name), "qwen3_coder", TEMPLATES / name
        )
        out[name] = load_tokenizer_dir(path)
    return out


def _render(tok, messages, kwargs=None):
    return render_chat(tok, messages, families.TOOLS, kwargs or {})


def test_with_preserve_thinking_a_new_question_only_appends_to_the_last_prompt(qwen):
    """Qwen3.6: the prompt of the answer turn plus the answer is where the next question's
    prompt starts, token for token, with the flag; without it the task's turns lose their
    reasoning and the prompt leaves the cache at the first of them."""
    tok = qwen["qwen3_6.jinja"]
    follow = [*TASK, ANSWER, Message("user", "And the license?")]
    for kwargs, appends in (({"preserve_thinking": True}, True), ({}, False)):
        before = _render(tok, TASK, kwargs).tokens
        answer = tok.encode(
            "The file is short.\n</think>\n\nIt has a title.", add_special_tokens=False
        )
        after = _render(tok, follow, kwargs).tokens
        n = len(before) + len(answer)
        assert (after[:n] == before + answer) is appends, kwargs


def test_reasoning_a_client_dropped_is_put_back_from_what_was_generated(qwen):
    """Sent back without reasoning, the turn renders as the model wrote it once the memo puts
    it back; a turn the client sent with its own reasoning is left as sent."""
    tok = qwen["qwen3_6.jinja"]
    kwargs = {"preserve_thinking": True}
    memo = ReasoningMemo()
    scope = ("local", "m", "s1")
    memo.remember(scope, CALL_TURN.content, CALL_TURN.tool_calls, "I read it first.")
    dropped = [*TASK[:2], CALL_TURN, TASK[3]]
    restored = memo.restore(scope, dropped)
    assert restored[2].reasoning == "I read it first."
    assert _render(tok, restored, kwargs).tokens == _render(tok, TASK, kwargs).tokens
    assert _render(tok, dropped, kwargs).tokens != _render(tok, TASK, kwargs).tokens
    # Another session, or a client's own reasoning, is not touched.
    assert memo.restore(("local", "m", "s2"), dropped)[2].reasoning is None
    own = Message("assistant", "", reasoning="Mine.", tool_calls=(CALL,))
    assert memo.restore(scope, [own])[0].reasoning == "Mine."
    assert memo.stats().restored == 1


CALL_TURN = Message("assistant", "", tool_calls=(CALL,))


def test_a_turn_is_known_by_its_text_and_calls_as_clients_reserialize_them():
    reordered = ToolCall("Read", {"limit": 20, "file_path": "README.md"}, "other-id")
    assert turn_digest("  It is.\n", (CALL,)) == turn_digest("It is.", (reordered,))
    assert turn_digest("It is.", (CALL,)) != turn_digest("It is.", ())
    changed = ToolCall("Read", {"file_path": "README.md", "limit": 21})
    assert turn_digest("It is.", (CALL,)) != turn_digest("It is.", (changed,))


def test_the_memo_is_bounded_by_bytes_oldest_first():
    memo = ReasoningMemo(max_bytes=3 * (100 + 160))
    scope = ("t", "m", "")
    for i in range(5):
        memo.remember(scope, f"answer {i}", None, "r" * 100)
    stats = memo.stats()
    assert (stats.entries, stats.evicted, stats.bytes) == (3, 2, 3 * 260)
    kept = [
        memo.restore(scope, [Message("assistant", f"answer {i}")])[0].reasoning for i in range(5)
    ]
    assert kept == [None, None, "r" * 100, "r" * 100, "r" * 100]


def test_the_next_question_prefix_is_what_every_question_starts_with(qwen):
    """Qwen3.5 drops the task's reasoning once a question follows: the prefix is the
    conversation as any next question renders it, through that question's header."""
    tok = qwen["qwen3_5.jinja"]
    prefix = next_question_prefix(tok, TASK, ANSWER, families.TOOLS, {})
    assert prefix is not None
    for question in ("And the license?", *PLACEHOLDERS, "42"):
        full = _render(tok, [*TASK, ANSWER, Message("user", question)]).tokens
        assert full[: len(prefix.tokens) - 1] == prefix.tokens[:-1], question
    head = tok.decode(prefix.tokens[:-1])
    assert head.endswith("It has a title.<|im_end|>\n<|im_start|>user\n")
    # The task's reasoning is gone from it, as the next question will render it.
    assert "I read it first." not in head and "The file is short." not in head


def test_a_reply_is_read_as_the_dialects_read_it(qwen):
    tok = qwen["qwen3_6.jinja"]
    fmt = OutputFormat.of(tok)
    prompt = _render(tok, TASK[:2]).text
    text = (
        "I read it first.\n</think>\n\n<tool_call>\n<function=Read>\n"
        "<parameter=file_path>\nREADME.md\n</parameter>\n"
        "<parameter=limit>\n20\n</parameter>\n</function>\n</tool_call>"
    )
    reply = read_reply(fmt, text, prompt, families.TOOLS, "stop")
    # As the dialects give it: the newline before </think> stays (Qwen's template trims it).
    assert (reply.reasoning, reply.content) == ("I read it first.\n", "")
    assert [(c.name, c.arguments) for c in reply.calls] == [(CALL.name, CALL.arguments)]


def test_an_openai_assistant_turn_may_send_its_reasoning_as_reasoning():
    """Clients and servers that use the newer name send `reasoning`; it reaches the
    template as `reasoning_content` does (the first one that is a string)."""
    from proxy.dialects.openai.chat import parse_messages

    def reasoning_of(fields):
        body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", **fields}]}
        return parse_messages(body)[1].reasoning

    assert reasoning_of({"content": "A.", "reasoning": "Why."}) == "Why."
    assert reasoning_of({"content": "A.", "reasoning_content": "Own.", "reasoning": "x"}) == "Own."
    assert reasoning_of({"content": "A.", "reasoning": None}) is None
