"""Greedy output with the prompt cache equals greedy output without it, for every cache type.

The main test of the state layer. Each request runs twice on one in-process Engine: with
the cache, and with `use_cache=False` (what `x-prompt-cache: bypass` sets); the texts must
be identical. Each cached request must also resume exactly where `HitModel` says the deepest
restorable position is, so a cache that silently stops hitting fails here too.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import DEMO_IDS, QWEN36, fresh_cache_dir
from tests.support.cache_driver import Driver, HitModel, Outcome, common_prefix

SYSTEM = (
    "You are a careful assistant inside a small workshop that repairs clocks, radios and "
    "bicycles. Answer in plain sentences. When a customer asks about a repair, say what is "
    "broken, what it costs and when it will be ready. Prices: a new chain is 18 euros, a "
    "clock spring 12 euros, a radio valve 25 euros. The shop opens at nine and closes at "
    "six, except on Sundays. Never promise a repair for the same day after four o'clock. "
    "If you do not know something, say so and offer to ask the owner, whose name is Ada. "
    "Keep a friendly tone, but be brief: two or three sentences are usually enough. When "
    "a question is about code, answer with a short Python function and one line that says "
    "why it works. Use metric units. Spell numbers under ten as words in running text. "
    "Repairs come with a warranty of three months on parts and one month on labour. Pay "
    "by card or in cash; invoices go out by email the same evening. Customers who wait "
    "may have tea in the back room. The van delivers within ten kilometres on Tuesdays "
    "and Fridays for five euros. Old parts go back to the customer unless they ask us to "
    "recycle them. Write dates as day, month name, year."
)
BASE = [{"role": "system", "content": SYSTEM}]
# Every cache kind, and our user's model shape (experts, the 248k vocabulary).
MODELS = (*DEMO_IDS, QWEN36)
# Qwen3.6's 248k vocabulary packs this prose into about half the demo tokenizer's tokens:
# a test that needs a prompt of so many blocks repeats it that much more.
PACKING = {QWEN36: 2}


def base(model: str) -> list[dict]:
    return [{"role": "system", "content": " ".join([SYSTEM] * PACKING.get(model, 1))}]


_tenants = itertools.count()


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str, **extra) -> dict:
    return {"role": "assistant", "content": text, **extra}


@pytest.fixture(scope="module")
def driver(demo_root, tmp_path_factory):
    d = Driver(fresh_cache_dir(demo_root, tmp_path_factory.mktemp("equivalence")), list(MODELS))
    yield d
    d.close()


class Conversation:
    """Asks one model with and without the cache, as a tenant of its own: nothing that
    earlier tests stored (in RAM or on SSD) can hit."""

    def __init__(self, driver: Driver, model: str):
        self.driver = driver
        self.model = model
        self.tenant = f"t{next(_tenants)}"
        self.hits = HitModel(driver.has_snapshots(model), ssd=driver.engine.tiers.ssd is not None)

    def cancel(self, messages, *, at: int) -> Outcome:
        """A request whose client goes away once prefill has passed token `at`."""
        cut = self.driver.generate(self.model, messages, tenant=self.tenant, cancel_at=at)
        self.hits.record(cut)
        return cut

    def ask(self, messages=None, *, prompt=None, tokens=None) -> Outcome:
        cold = self.driver.bypass(self.model, messages, prompt=prompt, tokens=tokens)
        warm = self.driver.generate(
            self.model, messages, prompt=prompt, tokens=tokens, tenant=self.tenant
        )
        assert (cold.cached, cold.source) == (0, "none")
        assert warm.tokens == cold.tokens
        assert warm.text == cold.text, (
            f"{self.model}: resumed at {warm.cached} of {len(warm.tokens)} tokens"
        )
        assert warm.cached == self.hits.expected(warm.tokens), (
            f"{self.model}: resumed at {warm.cached} of {len(warm.tokens)} tokens"
        )
        assert warm.source == self.hits.expected_source(warm.tokens)
        self.hits.record(warm)
        return warm


def resumable(previous, now) -> int:
    """How much of `previous`'s prompt `now` must restore: all of it but the last token
    (its prompt end) when it is a prefix of `now`'s; else, for a template whose history
    drops what its generation prompt opened (Qwen3.6's `<think>`), up to where that
    block opened, the checkpoint just before the two part."""
    if common_prefix(previous.tokens, now.tokens) >= len(previous.tokens) - 1:
        return len(previous.tokens) - 1
    assert previous.reply_opens_at is not None
    assert common_prefix(previous.tokens, now.tokens) == previous.reply_opens_at
    return previous.reply_opens_at


def repeat_hit(chat: Conversation, o: Outcome) -> int:
    """Where the same prompt again resumes: its prompt end; for a snapshot model whose
    generation prompt opened `<think>`, the checkpoint where it opened, which stands for
    the prompt end (prompt_cache.py)."""
    if chat.hits.snapshots and o.reply_opens_at is not None:
        return o.reply_opens_at
    return len(o.tokens) - 1


@pytest.mark.parametrize("model", MODELS)
def test_multi_turn_chat_with_answers_fed_back_matches_bypass(driver, model):
    chat = Conversation(driver, model)
    messages = [*base(model), user("My bicycle chain keeps slipping on hills. What should I do?")]
    follow_ups = ["How much will that cost?", "Can I pick it up today?", "Who is Ada?"]
    previous = None
    for follow_up in [*follow_ups, None]:
        o = chat.ask(messages)
        assert len(o.tokens) > 5 * 64
        if previous is not None:
            assert o.cached >= resumable(previous, o)
        previous = o
        if follow_up is not None:
            messages = [*messages, assistant(o.text), user(follow_up)]


@pytest.mark.parametrize("model", MODELS)
def test_branch_diverging_mid_block_matches_bypass(driver, model):
    chat = Conversation(driver, model)
    question = "The kitchen clock runs {} minutes fast every day since the battery change."
    a = chat.ask([*BASE, user(question.format("five"))])
    b = chat.ask([*BASE, user(question.format("eleven"))])
    lcp = common_prefix(a.tokens, b.tokens)
    assert lcp % 64 and b.message_starts[1] % 64, (lcp, b.message_starts)
    # A paged model resumes at the divergence itself; a snapshot model at the start of the
    # user message, the last checkpoint before it.
    assert b.cached == (b.message_starts[1] if chat.hits.snapshots else lcp)
    # The first branch is still intact next to its sibling.
    again = chat.ask([*BASE, user(question.format("five"))])
    assert again.cached == repeat_hit(chat, a)


@pytest.mark.parametrize("model", MODELS)
def test_supersequence_request_matches_bypass(driver, model):
    chat = Conversation(driver, model)
    first = [*BASE, user("Does the shop fix valve radios from the fifties?")]
    a = chat.ask(first)
    longer = [*first, assistant("Yes, valves cost 25 euros each."), user("And the dial light?")]
    b = chat.ask(longer)
    assert b.cached >= resumable(a, b)
    # Raw completions: the second prompt is the first with more text after it.
    text = SYSTEM + "\nQ: What does a clock spring cost?\nA:"
    c = chat.ask(prompt=text)
    d = chat.ask(prompt=text + " Twelve euros, fitted.\nQ: And a new chain?\nA:")
    assert d.cached >= len(c.tokens) - 1


@pytest.mark.parametrize("model", MODELS)
def test_continuing_the_generated_tokens_resumes_at_the_end_of_generation(driver, model):
    """The state after decoding (single-token steps) is a checkpoint like any other."""
    chat = Conversation(driver, model)
    a = chat.ask([*BASE, user("Write a short note for the van driver.")])
    more = driver.engine.models.loaded(model).tokenizer.encode(" Thanks, and one more thing:")
    b = chat.ask(tokens=a.tokens + a.out + more)
    assert b.cached == len(a.tokens) + len(a.out) - 1


@pytest.mark.parametrize("model", MODELS)
def test_prefix_and_exact_repeat_match_bypass(driver, model):
    chat = Conversation(driver, model)
    messages = [
        *BASE,
        user("Is the shop open on Sunday?"),
        assistant("No, it is closed on Sundays."),
        user("What about Saturday afternoon?"),
    ]
    full = chat.ask(messages)
    repeat = chat.ask(messages)
    assert repeat.cached == repeat_hit(chat, full)
    prefix = chat.ask(messages[:2])
    assert prefix.cached > 4 * 64


@pytest.mark.parametrize("model", MODELS)
def test_edit_in_an_early_message_matches_bypass(driver, model):
    chat = Conversation(driver, model)
    messages = [
        *BASE,
        user("I dropped my alarm clock and now it ticks but the hands do not move."),
        assistant("The hands may have slipped off the arbor; bring it in."),
        user("How long will the repair take?"),
        assistant("Usually two days."),
        user("Fine, I will bring it tomorrow morning."),
    ]
    original = chat.ask(messages)
    edited = [*messages]
    edited[1] = user("I dropped my wall clock and now it ticks but the hands do not move.")
    e = chat.ask(edited)
    lcp = common_prefix(original.tokens, e.tokens)
    assert lcp < len(e.tokens) - 40
    assert e.cached == (e.message_starts[1] if chat.hits.snapshots else lcp)
    # Going back to the original conversation restores it whole.
    back = chat.ask(messages)
    assert back.cached == repeat_hit(chat, original)


@pytest.mark.parametrize("model", MODELS)
def test_template_dropping_earlier_thinking_matches_bypass(driver, model):
    chat = Conversation(driver, model)
    call = {"type": "function", "function": {"name": "price", "arguments": {"part": "chain"}}}
    tool_turn = [
        *BASE,
        user("What does a new chain cost?"),
        assistant(
            "Let me check.",
            reasoning_content="The price list is in the system prompt, but check the tool.",
            tool_calls=[call],
        ),
        {"role": "tool", "content": "18 euros"},
    ]
    a = chat.ask(tool_turn)
    thought = "<think>\nThe price list is in the system prompt, but check the tool.\n</think>"
    assert thought in a.prompt_text
    next_turn = [*tool_turn, assistant("A new chain is 18 euros."), user("Thanks, and a bell?")]
    b = chat.ask(next_turn)
    assert thought not in b.prompt_text
    # The template keeps reasoning only after the last user message: the second prompt
    # drops it from the middle of the first, so the two part inside the assistant turn.
    assistant_start = a.message_starts[2]
    lcp = common_prefix(a.tokens, b.tokens)
    assert assistant_start < lcp < len(a.tokens) - 20
    assert b.cached == (assistant_start if chat.hits.snapshots else lcp)
    c = chat.ask([*next_turn, assistant("A bell is 6 euros."), user("Good.")])
    assert c.cached >= resumable(b, c)


@pytest.mark.parametrize("model", MODELS)
def test_prefill_cancelled_past_a_checkpoint_interval_resumes_there(driver, model):
    chat = Conversation(driver, model)
    notes = " ".join(f"Note {i}: {SYSTEM}" for i in range(4 * PACKING.get(model, 1)))
    messages = [{"role": "system", "content": notes}, user("Which note mentions the van?")]
    # Prefill stops at 512 (a chunk end) and 1024 (a periodic checkpoint), then the client
    # goes away: the request stores what it computed and answers nothing.
    cut = chat.cancel(messages, at=1000)
    assert cut.reached == 1024 < len(cut.tokens) - 100
    whole = chat.ask(messages)
    assert whole.cached == 1024
    # The finished request thinned the periodic checkpoint from RAM (a boundary now follows
    # it on the same path) before the SSD tier wrote it: only every 8th periodic checkpoint
    # goes to disk (SSD wear). An edit just after 1024 resumes at the edit on paged models
    # and recomputes on snapshot models.
    driver.flush_ssd()
    head, _, tail = notes.rpartition("ten kilometres")
    e = chat.ask([{"role": "system", "content": f"{head}12 km{tail}"}, messages[1]])
    assert 1024 < common_prefix(whole.tokens, e.tokens) < whole.message_starts[1]
    if chat.hits.snapshots:
        assert (e.cached, e.source) == (0, "none")


# --- property: random conversation trees -------------------------------------------------

WORDS = (
    "clock chain radio valve spring bell price today tomorrow why how much the a is "
    "broken fixed Ada shop open closed euros two 18 fast slow über naïve :) ok"
).split()
_text = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join)
# (operation, which earlier node, text, where in the node's messages)
_step = st.tuples(
    st.sampled_from(["extend", "tool", "branch", "append", "edit", "repeat"]),
    st.integers(0, 1 << 16),
    _text,
    st.integers(0, 1 << 16),
)


def _child(op: str, parent: list[dict], answer: str, text: str, where: int) -> list[dict]:
    if op == "extend":  # the next turn: the answer fed back, then a new question
        return [*parent, assistant(answer), user(text)]
    if op == "tool":  # a tool call whose reasoning the next user turn will strip
        call = {"type": "function", "function": {"name": "lookup", "arguments": {"q": text}}}
        msg = assistant(answer, reasoning_content=text, tool_calls=[call])
        return [*parent, msg, {"role": "tool", "content": text}]
    if op == "branch":  # a sibling: another question in place of the last one
        return [*parent[:-1], user(text)]
    if op == "append":  # the same last question with more words: diverges mid-message
        return [*parent[:-1], user(f"{parent[-1]['content']} {text}")]
    if op == "edit":  # insert words inside an earlier message, system prompt included
        i = where % len(parent)
        words = parent[i]["content"].split(" ")
        cut = where % (len(words) + 1)
        edited = " ".join([*words[:cut], text, *words[cut:]])
        return [*parent[:i], {**parent[i], "content": edited}, *parent[i + 1 :]]
    return list(parent)  # repeat


@pytest.mark.parametrize("model", MODELS)
@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(first=_text, steps=st.lists(_step, min_size=2, max_size=5))
def test_random_conversation_trees_match_bypass(driver, model, first, steps):
    chat = Conversation(driver, model)
    nodes: list[tuple[list[dict], str]] = []
    messages = [*BASE, user(first)]
    nodes.append((messages, chat.ask(messages).text))
    for op, pick, text, where in steps:
        parent, answer = nodes[pick % len(nodes)]
        messages = _child(op, parent, answer, text, where)
        nodes.append((messages, chat.ask(messages).text))
