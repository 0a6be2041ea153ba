"""GET /v1/cache/diagnosis on scripted scenarios, each on a real server through the OpenAI
SDK: the top cause of the tokens computed again and its fix are right, the tokens by
cause add up to the tokens computed again, and (where the fix is a setting) a server
started with the fix loses far fewer tokens to that cause on the same script."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
from aiohttp import web

from proxy.config.units import parse_duration, parse_size
from tests.cache.test_cache_http import long_system
from tests.cache.test_cache_requests import FOLLOW_UP, LLAMA, QUESTION, ask, oai
from tests.conftest import free_port, fresh_cache_dir, start_server
from tests.prompting.test_qwen36_real_template import REAL, real_template_copy

# Polls for a state the server reaches on its own (an expiry), not timing.
_WAIT_S = 120.0
UPSTREAM = ("--upstream", "http://127.0.0.1:9")


def diagnosis(server, **params) -> dict:
    r = httpx.get(server.url + "/v1/cache/diagnosis", params=params, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    # Every token computed again has exactly one cause.
    assert sum(c["tokens"] for c in body["causes"]) == body["computed_tokens"], body
    assert body["cached_tokens"] + body["computed_tokens"] == body["prompt_tokens"]
    return body


def top(body: dict) -> dict:
    """The cause that cost the most tokens, new content aside (nothing fixes that)."""
    return next(c for c in body["causes"] if c["cause"] != "new_content")


def tokens_of(body: dict, cause: str) -> int:
    return next((c["tokens"] for c in body["causes"] if c["cause"] == cause), 0)


def _server(demo_root, tmp_path, name: str, config: str = "", *args: str, env=None, model=LLAMA):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / name)
    extra = []
    if config:
        (cache_dir / "config.toml").write_text(config)
        extra = ["--config", str(cache_dir / "config.toml")]
    return start_server(cache_dir, *extra, "--model", model, *UPSTREAM, *args, env=env)


# --- a client that stamps the time into its system prompt ----------------------------------


def stamped(at: str) -> str:
    return "You are the ledger assistant.\nCurrent time: " + at + "\n" + long_system(14)


def stamped_turns(server, session: str) -> None:
    """Four turns of one conversation; the client rewrites the time in the system prompt
    on each."""
    client = oai(server, "t")
    history = [QUESTION]
    for turn in range(4):
        at = f"2026-12-05 0{turn}:1{turn}:{turn}7"
        messages = [{"role": "system", "content": stamped(at)}, *history]
        reply = ask(client, messages, session=session, rid=f"{session}-{turn}")[0]
        history += [{"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": f"{FOLLOW_UP['content']} ({turn})"}]  # fmt: skip


def test_a_time_stamped_system_prompt_is_named_with_a_rule_that_keeps_the_prefix(
    tmp_path, demo_root
):
    s = _server(demo_root, tmp_path, "stamp")
    try:
        stamped_turns(s, "stamp")
        body = diagnosis(s)
    finally:
        s.stop()
    cause = top(body)
    assert cause["cause"] == "client_rewrote", body["causes"]
    assert cause["share"] > 0.5 and cause["requests"] == 3
    fix = cause["fix"]
    assert fix["key"] == "normalization.rules", fix
    assert "message 0" in fix["text"], fix["text"]
    rule = fix["value"]
    assert re.search(rule["pattern"], stamped("2031-01-02 11:22:33")), rule
    # The rule, as the config file takes it, makes the same script hit.
    config = "[[normalization.rules]]\n" + "".join(
        f"{k} = {json.dumps(v)}\n" for k, v in rule.items()
    )
    fixed = _server(demo_root, tmp_path, "stamp-fixed", config)
    try:
        stamped_turns(fixed, "stamp")
        after = diagnosis(fixed)
    finally:
        fixed.stop()
    assert tokens_of(after, "client_rewrote") == 0, after["causes"]
    assert after["hit_ratio"] > body["hit_ratio"] + 0.3, (after["hit_ratio"], body["hit_ratio"])


# --- a RAM budget too small, with the SSD tier off -----------------------------------------

SSD_OFF = {"MLX_PROMPT_CACHE_CACHE_SSD_ENABLED": "false"}


def three_projects(server) -> None:
    """Three sessions' first turns, then each one's second: RAM holds about one at a time."""
    client = oai(server, "t")
    second = {}
    for name in "abc":
        turn1 = [{"role": "system", "content": long_system(10, salt=f"Project {name}. ")}, QUESTION]
        answer = ask(client, turn1, session=name, rid=f"{name}-1")[0].choices[0].message.content
        second[name] = [*turn1, {"role": "assistant", "content": answer}, FOLLOW_UP]
    for name in "abc":
        ask(client, second[name], session=name, rid=f"{name}-2")


def test_a_ram_budget_too_small_with_the_ssd_off_is_named_with_a_budget_that_holds_it(
    tmp_path, demo_root
):
    # demo-llama's blocks are 16 KB: 100 KB holds six, and each project is about four.
    # With the fixed settings (autotune off): with it on, the fix says autotune is growing
    # the budget, up to [autotune] ram_max.
    fixed_settings = "[autotune]\nenabled = false\n"
    s = _server(demo_root, tmp_path, "ram", fixed_settings, "--ram-budget", "100000", env=SSD_OFF)
    try:
        three_projects(s)
        body = diagnosis(s)
    finally:
        s.stop()
    cause = top(body)
    assert cause["cause"] == "evicted", body["causes"]
    assert cause["requests"] == 3 and cause["share"] > 0.3, cause
    fix = cause["fix"]
    assert fix["key"] == "cache.ram.budget", fix
    assert parse_size(fix["value"]) > 100_000
    assert "turn the SSD tier on" in fix["text"]
    budget = f'[cache.ram]\nbudget = "{fix["value"]}"\n'
    fixed = _server(demo_root, tmp_path, "ram-fixed", budget + fixed_settings, env=SSD_OFF)
    try:
        three_projects(fixed)
        after = diagnosis(fixed)
    finally:
        fixed.stop()
    assert tokens_of(after, "evicted") == 0, after["causes"]
    assert after["hit_ratio"] > body["hit_ratio"] + 0.2


# --- a session TTL shorter than the pause between turns ------------------------------------


def test_a_session_ttl_shorter_than_the_pause_is_named_with_a_ttl_that_outlasts_it(
    tmp_path, demo_root
):
    s = _server(demo_root, tmp_path, "ttl", env={"MLX_PROMPT_CACHE_CACHE_SESSION_TTL": "2s"})
    try:
        client = oai(s, "t")
        turn1 = [{"role": "system", "content": long_system(12, salt="Session C. ")}, QUESTION]
        answer = ask(client, turn1, session="c", rid="c-1")[0].choices[0].message.content
        turn2 = [*turn1, {"role": "assistant", "content": answer}, FOLLOW_UP]
        paused = time.monotonic()
        deadline = paused + _WAIT_S
        while "c" in sessions(s):
            assert time.monotonic() < deadline, "the session never expired"
            time.sleep(0.2)
        pause = time.monotonic() - paused
        ask(client, turn2, session="c", rid="c-2")
        body = diagnosis(s)
    finally:
        s.stop()
    cause = top(body)
    assert cause["cause"] == "expired", body["causes"]
    fix = cause["fix"]
    assert fix["key"] == "cache.session_ttl", fix
    assert parse_duration(fix["value"]) > max(pause, 2.0) * 1.5, (fix, pause)


def sessions(server) -> set[str]:
    r = httpx.get(server.url + "/v1/cache/sessions", headers={"x-tenant": "t"}, timeout=30)
    return {row["id"] for row in r.json()["sessions"]}


# --- a hybrid model whose checkpoints are sparse -------------------------------------------

QWEN36 = "demo-qwen36"  # Qwen3.6's Gated DeltaNet layers: it resumes only at checkpoints


def reminder_turns(server, session: str) -> None:
    """Two turns; the client rewrites a line at the end of its long first message (a
    reminder of what changed), as agents do: a paged model loses the line, a hybrid one
    whatever lies between its last checkpoint and the line."""
    client = oai(server, "t")
    document = long_system(70)
    history: list[dict] = []
    for turn in range(2):
        first = {
            "role": "user",
            "content": f"{document}\n<reminder>files changed: {turn + 3}</reminder>",
        }
        messages = [{"role": "system", "content": "You read documents."}, first, *history]
        raw = client.chat.completions.with_raw_response.create(
            model=QWEN36, messages=messages, max_tokens=4, temperature=0,
            extra_headers={"x-session-id": session, "x-request-id": f"{session}-{turn}"},
        )  # fmt: skip
        history = [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                   FOLLOW_UP]  # fmt: skip


def test_a_hybrid_model_with_sparse_checkpoints_is_named_with_a_closer_interval(
    tmp_path, demo_root
):
    sparse = "[cache.ram]\ncheckpoint_interval = 4096\n"
    s = _server(demo_root, tmp_path, "hybrid", sparse, model=QWEN36)
    try:
        reminder_turns(s, "h")
        body = diagnosis(s)
    finally:
        s.stop()
    cause = top(body)
    assert cause["cause"] == "checkpoint_spacing", body["causes"]
    fix = cause["fix"]
    assert fix["key"] == "cache.ram", fix
    assert fix["value"]["keep_periodic"] is True
    assert 64 <= fix["value"]["checkpoint_interval"] < 4096
    table = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fix["value"].items())
    fixed = _server(demo_root, tmp_path, "hybrid-fixed", "[cache.ram]\n" + table, model=QWEN36)
    try:
        reminder_turns(fixed, "h")
        after = diagnosis(fixed)
    finally:
        fixed.stop()
    assert tokens_of(after, "checkpoint_spacing") < cause["tokens"] / 2, after["causes"]


def test_tuning_takes_checkpoints_closer_until_a_hybrid_resumes_near_where_it_diverged(
    tmp_path, demo_root
):
    """The same sparse checkpoints with tuning on (its default): after the first sessions
    the tuner keeps periodic checkpoints, then takes them closer, and a later session's
    rewrites resume nearer the line they changed; answers stay those of a bypass."""
    config = '[cache.ram]\ncheckpoint_interval = 4096\n\n[autotune]\ninterval = "1s"\n'
    s = _server(demo_root, tmp_path, "hybrid-tuned", config, model=QWEN36)
    client, document = oai(s, "t"), long_system(70)
    short = []  # the tokens each turn resumed short of where it diverged
    try:
        for i in range(3):
            history: list[dict] = []
            for turn in range(2):  # each turn rewrites the reminder at the end
                first = {"role": "user", "content": f"{document}\n<reminder>{i}.{turn}</reminder>"}
                messages = [{"role": "system", "content": "You read documents."}, first, *history]
                reply = client.chat.completions.create(
                    model=QWEN36, messages=messages, max_tokens=4, temperature=0,
                    extra_headers={"x-session-id": f"s{i}"},
                ).choices[0].message.content  # fmt: skip
                history = [{"role": "assistant", "content": reply}, FOLLOW_UP]
                so_far = tokens_of(diagnosis(s), "checkpoint_spacing")
                short.append(so_far - sum(short))
            time.sleep(1.5)  # a look of the tuner
        auto = httpx.get(s.url + "/v1/cache/stats", timeout=30).json()["autotune"]
        bypass = client.chat.completions.create(
            model=QWEN36, messages=messages, max_tokens=4, temperature=0,
            extra_headers={"x-prompt-cache": "bypass"},
        ).choices[0].message.content  # fmt: skip
    finally:
        s.stop()
    assert bypass == reply
    spacing = [(c["setting"], c["from"], c["to"]) for c in auto["changes"]
               if c["setting"] in ("cache.ram.keep_periodic", "cache.ram.checkpoint_interval")]  # fmt: skip
    assert spacing[0] == ("cache.ram.keep_periodic", False, True), auto["changes"]
    closer = [to for setting, _, to in spacing[1:]]
    assert closer and closer == sorted(closer, reverse=True) and 256 <= closer[-1] < 4096, spacing
    assert auto["checkpoint_interval"] == closer[-1]
    # The first session's rewrite resumed at the document's start; the last one's, past
    # the periodic checkpoint its first turn took once tuning had brought them closer.
    assert short[0] == 0 and short[-1] < short[1] / 2, short


# --- a template that drops reasoning -------------------------------------------------------

LOOKUP = {
    "type": "function",
    "function": {
        "name": "read_ledger",
        "description": "Read one ledger entry",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
    },
}


def reasoning_turns(server, model: str) -> None:
    """A question answered through one tool call, then a new question: the client sends
    back each assistant turn's reasoning, as OpenAI-dialect agents that keep it do."""
    client = oai(server, "t")
    call = {"id": "call_1", "type": "function",
            "function": {"name": "read_ledger", "arguments": '{"id": "17"}'}}  # fmt: skip
    thinking = "The user wants the ledger entry. " + long_system(6)
    first = [{"role": "system", "content": "You keep the ledger."}, QUESTION]
    tool_round = [
        *first,
        {"role": "assistant", "content": "", "reasoning_content": thinking, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": long_system(20, salt="Entry 17. ")},
    ]
    question = [*tool_round, {"role": "assistant", "content": ANSWER_17}, FOLLOW_UP]
    for i, messages in enumerate((first, tool_round, question)):
        client.chat.completions.create(
            model=model, messages=messages, tools=[LOOKUP], max_tokens=4, temperature=0,
            extra_headers={"x-session-id": "r", "x-request-id": f"r-{i}"},
        )  # fmt: skip


ANSWER_17 = "Entry 17 is the March invoice for the north region."
REAL_NAME = "Qwen3.6-35B-A3B-real-template"


@pytest.mark.skipif(not REAL.is_file(), reason=f"the real templates are not here: {REAL}")
def test_a_template_that_drops_reasoning_is_named_with_the_flag_that_keeps_it(tmp_path, demo_root):
    # Qwen3.6's real template, on demo-qwen36's weights and vocabulary, with its flag off.
    path = real_template_copy(demo_root, tmp_path / "real" / REAL_NAME)
    config = (
        f'[model."{REAL_NAME}"]\nchat_template_kwargs = {{ preserve_thinking = false }}\n'
        "[cache.warm_ahead]\nenabled = false\n"
    )
    s = _server(demo_root, tmp_path, "drops", config, model=str(path))
    try:
        reasoning_turns(s, REAL_NAME)
        body = diagnosis(s)
    finally:
        s.stop()
    cause = top(body)
    assert cause["cause"] == "template_dropped_reasoning", body["causes"]
    fix = cause["fix"]
    assert fix["key"] == f'model."{REAL_NAME}".chat_template_kwargs', fix
    assert fix["value"] == {"preserve_thinking": True}
    # With the flag as the fix sets it (the engine's default), the same turns lose
    # nothing to the template.
    config = config.replace("preserve_thinking = false", "preserve_thinking = true")
    kept = _server(demo_root, tmp_path, "keeps", config, model=str(path))
    try:
        reasoning_turns(kept, REAL_NAME)
        after = diagnosis(kept)
    finally:
        kept.stop()
    assert tokens_of(after, "template_dropped_reasoning") == 0, after["causes"]
    assert after["hit_ratio"] > body["hit_ratio"]


# --- alerts --------------------------------------------------------------------------------


class Webhook:
    """A real HTTP endpoint in this process that keeps what is POSTed to it."""

    def __init__(self):
        self.posts: list[dict] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self._ready.wait(10)

    def _run(self):
        async def hook(request):
            self.posts.append(await request.json())
            return web.json_response({"ok": True})

        async def start():
            app = web.Application()
            app.router.add_post("/hook", hook)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def wait_for(self, event: str, key: str) -> dict:
        deadline = time.monotonic() + _WAIT_S
        while time.monotonic() < deadline:
            found = [p for p in self.posts if p["event"] == event and p["alert"]["key"] == key]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no {event!r} notice of {key} in {_WAIT_S:.0f} s: {self.posts}")


def test_an_alert_names_the_cause_and_its_fix_reaches_the_webhook_once_and_clears(
    tmp_path, demo_root
):
    hook = Webhook()
    # A window that holds a rewritten turn or two (each loses its ~300-token system
    # prompt), and that the test then waits out for the alerts to clear.
    config = (
        f'[alerts]\nwebhook = "{hook.url}"\nmin_tokens = 100\nwindow = "8s"\n'
        'interval = "1s"\nrepeat = "1h"\n'
    )
    s = _server(demo_root, tmp_path, "alerts", config)
    try:
        stamped_turns(s, "alerting")
        alert = hook.wait_for("raised", "client_rewrote")["alert"]
        assert alert["cause"] == "client_rewrote" and alert["fix"]["key"] == "normalization.rules"
        assert "client_rewrote" in alert["message"] and alert["share"] > 0.5
        on = httpx.get(s.url + "/v1/cache/stats", timeout=30).json()["alerts"]
        assert any(a["key"] == "client_rewrote" for a in on), on
        # The hit ratio fell too: its alert names the same cause and fix.
        low = hook.wait_for("raised", "hit_ratio")["alert"]
        assert low["cause"] == "client_rewrote" and low["fix"] == alert["fix"]
        # The window passes with no more rewrites: both clear.
        hook.wait_for("cleared", "client_rewrote")
        hook.wait_for("cleared", "hit_ratio")
        assert httpx.get(s.url + "/v1/cache/stats", timeout=30).json()["alerts"] == []
        log = s.log_path.read_text()
        assert "alert client_rewrote:" in log and "normalization.rules" in log
    finally:
        s.stop()
    raised_notices = [p for p in hook.posts if p["event"] == "raised"]
    assert len({p["alert"]["key"] for p in raised_notices}) == len(raised_notices), hook.posts
