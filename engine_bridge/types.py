"""The neutral request and event types that cross from proxy/ into engine_bridge/.

proxy/ turns an OpenAI or Anthropic body into a `GenerationRequest`; the runner answers
with a stream of `TokenEvent`s and one final `GenerationResult`. No dialect leaks in here.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

CacheSource = Literal["ram", "ssd", "shared", "none"]
Role = Literal["system", "user", "assistant", "tool"]
PartKind = Literal["text", "reasoning", "tool_call"]
# Why a request got less than its whole prompt from the cache (ops/request_log.py).
MissReason = Literal[
    "hit",
    "new_session",
    "evicted_ram",
    "evicted_ssd",
    "expired",
    "history_edited",
    "system_or_tools_changed",
    "template_changed",
    "history_rewritten",
    "bypass",
    "partial",
    "tier_late",
]
# Why prompt tokens were computed again (ops/diagnosis.py, GET /v1/cache/diagnosis).
Cause = Literal[
    "new_content",
    "evicted",
    "evicted_ssd",
    "expired",
    "client_rewrote",
    "template_dropped_reasoning",
    "template_changed",
    "checkpoint_spacing",
    "other_tenant_or_model",
    "tier_fault",
    "bypass",
    "unexplained",
]
FinishReason = Literal["stop", "length", "stop_string", "cancelled"]


class EngineHalted(RuntimeError):
    """Work offered to an engine that stopped for good (its MLX thread halted, or a split
    model lost a rank): the message says why."""


class EngineError(Exception):
    """A request the engine refuses before generating (a client's mistake, or no room).

    Maps to a 4xx in the dialect's error shape; `retry_after_s` (429) says when to retry.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        status: int = 400,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.field = field
        self.status = status
        self.retry_after_s = retry_after_s


class GenerationFailed(Exception):
    """A generation that had started failed inside the engine; raised from the stream.

    By then the response may be under way, so the proxy ends it with the dialect's own
    mid-stream error rather than a second response.
    """


@dataclass(slots=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the assistant made, as both dialects and chat templates know it."""

    name: str
    # A JSON value, usually an object; a string when the client sent arguments that are not
    # JSON, which templates then render as they are.
    arguments: Any
    id: str | None = ""

    def to_template(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Which calls the client allows: both dialects' tool_choice and parallel switches."""

    # "auto": the model decides; "none": no call (the tools stay in the prompt, so the
    # cache still hits); "required": the answer opens with a call, to `name` when set.
    mode: Literal["auto", "none", "required"] = "auto"
    name: str | None = None
    # False: the turn ends after its first call (Anthropic disable_parallel_tool_use,
    # OpenAI parallel_tool_calls: false).
    parallel: bool = True


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image as the client sent it (the encoded file); the engine decodes it."""

    data: bytes
    media_type: str = ""
    # Where it sat in the body (messages[2].content[1].source.data), for 4xx errors; not
    # part of its identity, so the same image one turn later compares equal.
    field: str = field(default="", compare=False)


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message; `to_template` is the only place it becomes the chat-template shape.

    Optional fields are None when the client left them out: some templates test whether a
    key is there (`'tool_calls' in message`) rather than whether it is empty.
    """

    role: Role
    content: str = ""
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    # Text and images in order, when the content has images; `content` is then its text.
    parts: tuple[str | ImageInput, ...] | None = None

    def to_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.parts is not None:
            out["content"] = [
                {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                for p in self.parts
            ]
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls is not None:
            out["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    @classmethod
    def from_template(cls, message: dict[str, Any]) -> Message:
        """The inverse of `to_template`, for callers that hold template-shaped dicts (tests,
        probes); text parts of a content list are joined, as the dialects join them."""
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if p.get("type") == "text")
        calls = message.get("tool_calls")
        if calls is not None:
            calls = tuple(
                ToolCall(c["function"]["name"], c["function"].get("arguments"), c.get("id", ""))
                for c in calls
            )
        return cls(
            message["role"],
            content or "",
            message.get("reasoning_content"),
            calls,
            message.get("tool_call_id"),
        )


@dataclass(slots=True)
class GenerationRequest:
    """One request, dialect-free: either chat `messages` or a raw `prompt`."""

    model: str
    messages: list[Message] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    tenant: str = "local"
    use_cache: bool = True
    request_id: str = ""
    # Extra keyword arguments for the chat template (e.g. enable_thinking).
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Put back reasoning the client dropped from earlier assistant turns (turns.py).
    restore_reasoning: bool = True
    # Token ids to use as they are, instead of rendering `messages` or encoding `prompt`
    # (OpenAI legacy completions accept a token array as the prompt).
    prompt_tokens: list[int] | None = None
    # Who is asking, for fair scheduling: the client's session id when it sends one
    # (Claude Code's X-Claude-Code-Session-Id, x-session-id, metadata.user_id, user).
    session: str = ""
    # Prefill and store the prompt, then stop before the first token (POST /v1/cache/warm).
    prefill_only: bool = False
    # Speculative decoding as the engine is set to; False for this request only
    # (`x-speculative: off`, for comparisons).
    speculative: bool = True


@dataclass(slots=True)
class PromptInfo:
    """What the runner learned before decoding: sizes and what the cache gave."""

    prompt_tokens: int
    cached_tokens: int
    source: CacheSource
    # The token index where the prompt left a sequence the cache holds, when it did.
    diverged_at: int | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine says about a model it serves; sizes are known once it is loaded."""

    id: str
    loaded: bool
    arch: str | None = None
    context_length: int | None = None
    cache_kind: str = "unknown"
    # How many sequences decode together in one step (1 when the cache cannot batch).
    max_batch: int | None = None
    # Loaded with its vision tower: images in requests are seen (LM Studio's "vlm").
    vision: bool = False


@dataclass(slots=True)
class TokenEvent:
    """Newly decoded text, sent when a token adds some: a token that completes no character
    yet (part of a multi-byte one), or whose text is held as a possible stop string's
    start, sends none, and the next event counts it in `tokens`."""

    text: str
    token: int  # the last of them
    tokens: int = 1  # the output tokens `text` was decoded from, since the previous event


@dataclass(slots=True)
class Part:
    """A piece of a model's output as the parser reads it (prompting/output_format.py)."""

    kind: PartKind
    text: str = ""
    call: ToolCall | None = None  # set for kind "tool_call"


def new_call_id(prefix: str = "call_") -> str:
    return prefix + uuid.uuid4().hex[:24]


def merge(parts: list[Part]) -> list[Part]:
    """Coalesce adjacent parts of the same kind (for non-streaming responses)."""
    out: list[Part] = []
    for p in parts:
        if out and p.kind != "tool_call" and out[-1].kind == p.kind:
            out[-1].text += p.text
        else:
            out.append(Part(p.kind, p.text, p.call))
    return out


@dataclass(slots=True)
class GenerationResult:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    source: CacheSource
    finish_reason: FinishReason
    text: str
    ttft_s: float
    generation_s: float
    stop_string: str | None = None
    # False for bypassed requests and cache-less models: they stay out of the hit ratio.
    used_cache: bool = True
    # Time to look the prompt up and restore its cached state (SSD promotion included),
    # and time the model spent prefilling the rest, over `prefilled_tokens` tokens.
    restore_s: float = 0.0
    prefill_s: float = 0.0
    prefilled_tokens: int = 0

    @property
    def prefill_tok_s(self) -> float | None:
        """The model's prefill speed on this request; None when it prefilled nothing."""
        return self.prefilled_tokens / self.prefill_s if self.prefill_s > 0 else None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What a request would get from each tier now (POST /v1/cache/probe)."""

    model: str
    prompt_tokens: int
    ram_tokens: int  # restored from RAM
    ssd_tokens: int  # read from this machine's SSD, past what RAM has
    shared_tokens: int  # read from the shared store ([cache.shared]), past RAM and SSD
    recompute_tokens: int  # prefilled by the model (always at least one)
    diverged_at: int | None  # where the prompt leaves a sequence RAM holds


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What a warm-up prefilled and stored (POST /v1/cache/warm)."""

    model: str
    prompt_tokens: int
    cached_tokens: int  # already cached before the warm-up
    stored_tokens: int  # newly prefilled and now cached
    elapsed_s: float


def conversation_id(messages: list[Message] | None) -> str:
    """The session of a client that names none: 'h-' and 16 hex digits of the SHA-256 of
    the first user message, the same on every turn of the conversation ("" without one).
    The proxy, the scheduler's lanes and the request log all know a conversation by it."""
    for m in messages or ():
        if m.role == "user":
            digest = hashlib.sha256(m.content.encode("utf-8", "surrogatepass")).hexdigest()
            return "h-" + digest[:16]
    return ""
