"""The crash soak's traffic: conversations that share prefixes and grow turn by turn, and
SDK clients that keep what arrived of an answer when the server is killed under them.

Used by tests/tools/crash_soak.py, which says what is checked.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

import anthropic
import httpx
import openai

MODELS = ("demo-llama", "demo-hybrid", "demo-swa")
CLIENTS = 6
MAX_TOKENS = 12
TURNS = 6  # user turns per conversation
SYSTEMS = 3  # system prompts per model, each shared by several conversations
CONVERSATIONS = 4  # fixed conversations per system prompt, answered in every round
NEW_PER_ROUND = 2  # conversations per model that are new in a round: fresh writes
DIALECTS = ("openai", "openai-stream", "anthropic", "anthropic-stream")

_WORDS = (
    "ledger region invoice shipment refund warehouse audit payroll quota carrier customer "
    "report backlog ticket parcel contract supplier budget forecast currency month archive "
    "queue record history policy discount return label pallet route driver depot batch"
).split()


# -- prompts ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prompt:
    pid: str
    model: str
    system: str
    turns: tuple[str, ...]  # user, assistant, user, ..., user

    def messages(self) -> list[dict[str, str]]:
        roles = ("user", "assistant")
        return [{"role": roles[i % 2], "content": t} for i, t in enumerate(self.turns)]


def _prose(rng: random.Random, sentences: int) -> str:
    out = []
    for _ in range(sentences):
        words = rng.choices(_WORDS, k=rng.randint(8, 14))
        out.append(" ".join(words).capitalize() + ".")
    return " ".join(out)


def conversation(model: str, name: str, system: str, rng: random.Random) -> list[Prompt]:
    """TURNS prompts, each the one before plus a scripted answer and a new question."""
    turns: list[str] = []
    prompts = []
    for t in range(TURNS):
        if t:
            turns.append(_prose(rng, 1))
        turns.append(_prose(rng, 1).rstrip(".") + "?")
        prompts.append(Prompt(f"{model}/{name}/t{t}", model, system, tuple(turns)))
    return prompts


@dataclass(slots=True)
class Pool:
    """Conversations by model: fixed ones (SSD hits after restarts) and each round's new ones."""

    seed: int
    systems: dict[str, list[str]] = field(default_factory=dict)
    fixed: list[list[Prompt]] = field(default_factory=list)
    by_pid: dict[str, Prompt] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        texts = [_prose(rng, 8) for _ in range(SYSTEMS)]  # ~270 tokens: 4 blocks each
        for model in MODELS:
            self.systems[model] = texts
            for s, system in enumerate(texts):
                for c in range(CONVERSATIONS):
                    self._add(conversation(model, f"s{s}c{c}", system, rng), self.fixed)

    def new_for_round(self, round_: int) -> list[list[Prompt]]:
        rng = random.Random(f"{self.seed}/{round_}")
        out: list[list[Prompt]] = []
        for model in MODELS:
            for k in range(NEW_PER_ROUND):
                system = rng.choice(self.systems[model])
                self._add(conversation(model, f"r{round_}c{k}", system, rng), out)
        return out

    def _add(self, conv: list[Prompt], into: list[list[Prompt]]) -> None:
        into.append(conv)
        self.by_pid.update((p.pid, p) for p in conv)


# -- one request -------------------------------------------------------------------------------


@dataclass(slots=True)
class Reply:
    pid: str
    dialect: str
    text: str = ""  # reasoning then content, as both dialects split them
    source: str = ""
    cached: int = 0
    error: str | None = None  # a failure before the kill
    cut: bool = False  # failed because the server was killed under it


class Client:
    """One client thread's SDK clients for a server."""

    def __init__(self, url: str) -> None:
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0, timeout=60)
        self.anthropic = anthropic.Anthropic(
            base_url=url, api_key="soak", max_retries=0, timeout=60
        )

    def close(self) -> None:
        self.openai.close()
        self.anthropic.close()

    def ask(self, prompt: Prompt, dialect: str, reply: Reply) -> None:
        """Fill `reply` as the answer arrives, so a stream cut by the kill keeps its prefix."""
        kw = {"model": prompt.model, "max_tokens": MAX_TOKENS}
        if dialect.startswith("openai"):
            system = [{"role": "system", "content": prompt.system}]
            kw.update(messages=system + prompt.messages(), temperature=0)
            api = self.openai.chat.completions
        else:  # the Anthropic SDK no longer takes `temperature` as an argument
            kw.update(
                system=prompt.system, messages=prompt.messages(), extra_body={"temperature": 0}
            )
            api = self.anthropic.messages
        if not dialect.endswith("stream"):
            raw = api.with_raw_response.create(**kw)
            _headers(reply, raw.headers)
            reply.text = _text(raw.parse())
            return
        with api.with_streaming_response.create(stream=True, **kw) as raw:
            _headers(reply, raw.headers)
            for event in raw.parse():
                reply.text += _delta(event)


def _headers(reply: Reply, headers) -> None:
    reply.source = headers.get("x-prompt-cache-source", "")
    reply.cached = int(headers.get("x-prompt-cache-hit-tokens", 0))


def _text(message) -> str:
    if hasattr(message, "choices"):
        m = message.choices[0].message
        return (getattr(m, "reasoning_content", None) or "") + (m.content or "")
    parts = [getattr(b, "thinking", None) or getattr(b, "text", "") for b in message.content]
    return "".join(parts)


def _delta(event) -> str:
    if hasattr(event, "choices"):
        if not event.choices:
            return ""
        d = event.choices[0].delta
        return (getattr(d, "reasoning_content", None) or "") + (d.content or "")
    if event.type == "content_block_delta":
        return getattr(event.delta, "thinking", None) or getattr(event.delta, "text", "")
    return ""


def bypass_answer(url: str, prompt: Prompt) -> str:
    """The reference: the same prompt with the cache neither read nor written."""
    body = {
        "model": prompt.model,
        "messages": [{"role": "system", "content": prompt.system}, *prompt.messages()],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    r = httpx.post(
        url + "/v1/chat/completions", json=body, headers={"x-prompt-cache": "bypass"}, timeout=120
    )
    r.raise_for_status()
    m = r.json()["choices"][0]["message"]
    return (m.get("reasoning_content") or "") + (m.get("content") or "")


# -- traffic -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Traffic:
    """CLIENTS threads walking conversations turn by turn until the server dies under them."""

    url: str
    conversations: list[list[Prompt]]
    fresh: list[list[Prompt]]
    rng: random.Random
    killing: threading.Event = field(default_factory=threading.Event)
    replies: list[Reply] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for i in range(CLIENTS):
            args = (Client(self.url), random.Random(self.rng.random()))
            t = threading.Thread(target=self._client, args=args, name=f"soak-client-{i}")
            self._threads.append(t)
        for t in self._threads:
            t.start()

    def join(self) -> None:
        for t in self._threads:
            t.join(120)
            assert not t.is_alive(), f"{t.name} still running 120 s after the kill"

    def _client(self, client: Client, rng: random.Random) -> None:
        try:
            while not self.killing.is_set():
                conv = rng.choice(self.fresh if rng.random() < 0.3 else self.conversations)
                first = rng.randrange(TURNS)
                for prompt in conv[first : first + rng.randint(1, 3)]:
                    if self.killing.is_set() or not self._one(client, prompt, rng.choice(DIALECTS)):
                        return
        finally:
            client.close()

    def _one(self, client: Client, prompt: Prompt, dialect: str) -> bool:
        reply = Reply(prompt.pid, dialect)
        try:
            client.ask(prompt, dialect, reply)
        except Exception as e:  # noqa: BLE001 - any failure after the kill is the kill's
            if self.killing.is_set():
                reply.cut = True
            else:
                reply.error = f"{type(e).__name__}: {e}"[:300]
        with self._lock:
            self.replies.append(reply)
        return reply.error is None and not reply.cut
