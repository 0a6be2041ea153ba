"""Why a request missed: the last requests with what the cache gave and a reason class.

Each finished request is compared with the previous request of its session (tenant,
model, session id): how far their tokens agree says how much the cache could have given,
the messages say why the prompt left the earlier one, the tiers' eviction records
(`LookupReport.lost`) say whether what came next was evicted or expired, and the
read-ahead (`LookupReport.late`) whether a tier below RAM missed its deadline. A hit-ratio
alert watches the last `ALERT_WINDOW` requests that used the cache.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import threading
import time
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from ..cache.hashing import common_prefix
from ..prompt_cache import LookupReport
from ..types import (
    GenerationRequest,
    GenerationResult,
    ImageInput,
    Message,
    MissReason,
    conversation_id,
)
from .diagnosis import Diagnosis, Evidence, Loss, split


class Finished(Protocol):
    """What the log reads of a finished sequence (scheduling/sequence.py's Seq; ops/ sits
    below the scheduler): its job, its cache session, its output and when it started."""

    job: Any
    session: Any
    out: list[int]
    start: float


log = logging.getLogger("engine_bridge.ops.request_log")

MAX_RECORDS = 500
# Sessions whose previous prompt is kept to compare the next one with (LRU beyond this).
MAX_SESSIONS = 256
ALERT_WINDOW = 20
# Other sessions a new session's prompt is compared with (the newest first), to find what
# the cache had seen of it: a shared system prompt, another tenant's copy.
NEIGHBOURS = 32
# A new session whose system prompt left another session's there was rewritten by its
# client (a stamp) only if the two re-align by the end of it: ends this close, the same
# last tokens. Two agents' different system prompts never do.
REALIGN_SLACK, REALIGN_TOKENS = 32, 16


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request, as GET /v1/cache/requests lists it."""

    id: str
    time: float  # unix seconds when it arrived
    model: str
    tenant: str
    session: str
    prompt_tokens: int
    hit_tokens: int
    source: str
    ttft_s: float
    prefill_tok_s: float | None
    diverged_at: int | None
    diverged_message: int | None
    before: str
    after: str
    reason: MissReason

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class PromptSummary:
    """What a session's previous request left to compare the next one with."""

    tokens: array  # the prompt, plus the output the cache stored after it
    message_starts: tuple[int, ...]
    message_index: tuple[int, ...]
    messages: tuple[bytes, ...]  # a digest per message, as text
    head: bytes  # a digest of the leading system messages and the tools
    ends: tuple[int, ...]  # where its prompt ended and its generation (checkpoints)
    # Assistant messages before the last user message: where templates that drop earlier
    # reasoning (Qwen3.5/3.6, GLM-4.7, MiniMax, gpt-oss, Gemma 4) render other tokens.
    past_turns: frozenset[int] = frozenset()
    head_messages: int = 0  # the leading system messages (the tools render with them)
    at: float = 0.0  # when the request arrived (monotonic seconds)
    # Message starts with no save point: tool results' (render.py `resume_points`).
    unsaved: frozenset[int] = frozenset()

    def message_at(self, token: int) -> int:
        """The message holding `token` (0 before the first known start)."""
        i = bisect.bisect_right(self.message_starts, token) - 1
        return self.message_index[i] if i >= 0 else 0

    def start_of(self, message: int, default: int) -> int:
        """The first token of `message` or of a later one; `default` past the last."""
        i = bisect.bisect_left(self.message_index, message)
        return self.message_starts[i] if i < len(self.message_starts) else default


def summarize(req: GenerationRequest, prompt_tokens: Sequence[int], out: Sequence[int],
              message_starts: Sequence[int], message_index: Sequence[int],
              at: float = 0.0, unsaved: frozenset[int] = frozenset()) -> PromptSummary:  # fmt: skip
    messages = req.messages or []
    # The cache holds the prompt plus every generated token but the last (never fed back).
    stored = array("i", prompt_tokens)
    stored.extend(out[:-1])
    ends = (len(prompt_tokens) - 1, len(stored)) if len(out) > 1 else (len(prompt_tokens) - 1,)
    n_head = next((i for i, m in enumerate(messages) if m.role != "system"), len(messages))
    head = hashlib.blake2b(digest_size=16)
    for m in messages[:n_head]:
        head.update(_digest(m))
    head.update(repr(req.tools).encode())
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    past = frozenset(i for i, m in enumerate(messages[:last_user]) if m.role == "assistant")
    return PromptSummary(
        stored,
        tuple(message_starts),
        tuple(message_index),
        tuple(_digest(m) for m in messages),
        head.digest(),
        ends,
        past,
        n_head,
        at,
        unsaved,
    )


def _digest(message: Message) -> bytes:
    """The message's identity as canonical JSON: an image as its size and a digest of its
    bytes, never its repr (which spells out every byte of the encoded file)."""
    parts = None
    if message.parts is not None:
        parts = [p if isinstance(p, str) else _image(p) for p in message.parts]
    calls = None
    if message.tool_calls is not None:
        calls = [[c.name, c.arguments, c.id] for c in message.tool_calls]
    canonical = [message.role, message.content, message.reasoning, calls,
                 message.tool_call_id, parts]  # fmt: skip
    # Keys in the order sent, not sorted: a call's arguments render in that order, so two
    # orders are two prompts (as they were two reprs). ASCII-only, lone surrogates escaped.
    text = json.dumps(canonical, separators=(",", ":"), default=repr)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _image(image: ImageInput) -> dict[str, object]:
    digest = hashlib.blake2b(image.data, digest_size=16).hexdigest()
    return {"image": digest, "bytes": len(image.data), "media_type": image.media_type}


def classify(
    cur: PromptSummary,
    prompt_len: int,
    prev: PromptSummary | None,
    report: LookupReport | None,
    used_cache: bool,
) -> MissReason:
    """The reason class of one request's hit (see the module doc)."""
    if not used_cache or report is None:
        return "bypass"
    hit, last = report.restored, prompt_len - 1  # a request always prefills one token
    if hit >= last:
        return "hit"
    if report.late and (
        report.late_reach > hit  # the late tier's own plan reached further than the hit
        or (report.lost == "evicted_ram" and "ssd" in report.late)  # a copy unasked for
    ):
        return "tier_late"
    if report.lost is not None:
        return report.lost  # type: ignore[return-value]
    if prev is None:
        full = last // report.block_size * report.block_size
        return "hit" if hit and hit >= full else "new_session"
    reach = min(common_prefix(cur.tokens[:prompt_len], prev.tokens), last)
    if hit < _possible(reach, prev, report):
        # The cache held less than the session stored: a tier that may hold the rest was
        # late, or no record says why.
        return "tier_late" if report.late else "partial"
    if reach >= last or cur.message_at(reach) >= len(prev.messages):
        return "hit" if hit else "partial"  # every earlier message rendered as before
    if cur.head != prev.head:
        return "system_or_tools_changed"
    if cur.messages[: len(prev.messages)] == prev.messages:
        # The same text, other tokens: where a new question made an earlier turn a past one,
        # the template dropped its reasoning.
        if cur.message_at(reach) in cur.past_turns - prev.past_turns:
            return "history_rewritten"
        return "template_changed"
    return "history_edited"


def _possible(reach: int, prev: PromptSummary, report: LookupReport) -> int:
    """The deepest position up to `reach` the previous request left something to resume at:
    the end of its prompt or generation (checkpoints), a block boundary for paged models,
    a message start for snapshot models (checkpointed as prefill passes it)."""
    points = [p for p in prev.ends if p <= reach]
    if report.snapshots:
        points += [p for p in prev.message_starts if p <= reach and p not in prev.unsaved]
    else:
        points.append(reach // report.block_size * report.block_size)
    return max(points, default=0)


class HitRatioAlert:
    """Hit ratio (cached / prompt tokens) of the last `window` cacheable requests below a
    threshold; logs once when it starts and once when it clears. Threshold 0: off."""

    def __init__(self, threshold: float, window: int = ALERT_WINDOW):
        self.threshold = threshold
        self.window: deque[tuple[int, int]] = deque(maxlen=window)
        self.active = False

    @property
    def hit_ratio(self) -> float:
        prompt = sum(p for p, _ in self.window)
        return sum(h for _, h in self.window) / prompt if prompt else 0.0

    def add(self, prompt_tokens: int, hit_tokens: int) -> None:
        if self.threshold <= 0:
            return
        self.window.append((prompt_tokens, hit_tokens))
        low = len(self.window) == self.window.maxlen and self.hit_ratio < self.threshold
        if low and not self.active:
            log.warning("%s", self._message())
        elif self.active and not low:
            log.info(
                "prompt cache hit ratio of the last %d requests is back to %.0f%%",
                len(self.window),
                self.hit_ratio * 100,
            )
        self.active = low

    def _message(self) -> str:
        return (
            f"prompt cache hit ratio of the last {len(self.window)} requests is "
            f"{self.hit_ratio:.0%}, below {self.threshold:.0%}: GET /v1/cache/requests says "
            "why they missed"
        )

    def state(self) -> dict | None:
        if not self.active:
            return None
        return {
            "message": self._message(),
            "hit_ratio": round(self.hit_ratio, 4),
            "threshold": self.threshold,
            "window": len(self.window),
        }


class RequestLog:
    """The last `MAX_RECORDS` requests; filled on the MLX thread, read on the event loop."""

    def __init__(self, alert_hit_ratio: float = 0.5, diagnosis: Diagnosis | None = None):
        self._records: deque[RequestRecord] = deque(maxlen=MAX_RECORDS)
        # Every token computed again, by cause (diagnosis.py).
        self.diagnosis = diagnosis or Diagnosis()
        self._sessions: OrderedDict[tuple[str, str, str], PromptSummary] = OrderedDict()
        self._lock = threading.Lock()
        self.alert = HitRatioAlert(alert_hit_ratio)
        # Requests by (model, reason) since start: what /metrics counts misses by.
        self._reasons: Counter[tuple[str, MissReason]] = Counter()

    def on_done(self, seq: Finished, result: GenerationResult) -> None:
        """Record a finished sequence (the runner's `on_done`)."""
        job = seq.job
        req, prompt = job.request, job.prompt
        report: LookupReport | None = getattr(seq.session, "lookup", None)
        cur = summarize(req, prompt.tokens, seq.out, prompt.message_starts,
                        prompt.message_index, seq.start, prompt.tool_starts)  # fmt: skip
        key = (req.tenant, req.model, req.session or _conversation(req))
        with self._lock:
            prev = self._sessions.get(key)
            neighbours = [] if prev is not None else self._neighbours(key)
            if result.used_cache:
                self._sessions[key] = cur
                self._sessions.move_to_end(key)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            if req.prefill_only:
                return  # a warm-up: the session knows its prompt now; it is not a request
            reason = classify(cur, len(prompt.tokens), prev, report, result.used_cache)
            self._reasons[req.model, reason] += 1
        arrived = time.time() - (time.perf_counter() - seq.start)
        # Outside the lock: the comparisons read only this request's and frozen summaries.
        loss = lost(req, result, cur, prev, neighbours, report, reason,
                    getattr(seq.session, "decode", None))  # fmt: skip
        self.diagnosis.add(replace(loss, time=arrived, session=key[2]))
        with self._lock:
            self._records.append(
                RequestRecord(
                    id=req.request_id,
                    time=arrived,
                    model=req.model,
                    tenant=req.tenant,
                    session=req.session,
                    prompt_tokens=result.prompt_tokens,
                    hit_tokens=result.cached_tokens,
                    source=result.source,
                    ttft_s=round(result.ttft_s, 4),
                    prefill_tok_s=_round(getattr(result, "prefill_tok_s", None)),
                    diverged_at=report.diverged_at if report else None,
                    diverged_message=report.message if report else None,
                    before=report.before if report else "",
                    after=report.after if report else "",
                    reason=reason,
                )
            )
            if result.used_cache:
                self.alert.add(result.prompt_tokens, result.cached_tokens)

    def recent(self, limit: int, tenant: str | None = None) -> list[RequestRecord]:
        """Newest first; only `tenant`'s when given."""
        with self._lock:
            records = list(self._records)
        out = []
        for r in reversed(records):
            if tenant is None or r.tenant == tenant:
                out.append(r)
                if len(out) == limit:
                    break
        return out

    def _neighbours(
        self, key: tuple[str, str, str]
    ) -> list[tuple[tuple[str, str, str], PromptSummary]]:
        """The newest other sessions (under the lock)."""
        out = []
        for other in reversed(self._sessions):
            if other != key:
                out.append((other, self._sessions[other]))
                if len(out) == NEIGHBOURS:
                    break
        return out

    def reason_totals(self) -> dict[tuple[str, MissReason], int]:
        with self._lock:
            return dict(self._reasons)

    def alert_state(self) -> dict | None:
        with self._lock:
            return self.alert.state()


def lost(
    req: GenerationRequest,
    result: GenerationResult,
    cur: PromptSummary,
    prev: PromptSummary | None,
    neighbours: Sequence[tuple[tuple[str, str, str], PromptSummary]],
    report: LookupReport | None,
    reason: MissReason,
    decode: Any = None,
) -> Loss:
    """One request's tokens computed again, by cause (diagnosis.split), with the evidence
    each fix is worded from. `neighbours`: other sessions' summaries, for a new session."""
    n, hit = result.prompt_tokens, result.cached_tokens
    prompt = cur.tokens[:n]
    snapshots = bool(report and report.snapshots)
    reach, new_from, was_of = 0, n, prev
    foreign = 0
    if prev is not None:
        reach = common_prefix(prompt, prev.tokens)
        new_from = cur.start_of(len(prev.messages), n)
    elif reason not in ("bypass", "hit"):
        same, other = req.tenant, req.model
        best: tuple[int, PromptSummary | None] = (0, None)
        for (tenant, model, _), summary in neighbours:
            agree = common_prefix(prompt, summary.tokens)
            if tenant == same and model == other:
                best = max(best, (agree, summary), key=lambda b: b[0])
            else:
                foreign = max(foreign, agree)
        reach, was_of = best
        if was_of is not None and _restamped(cur, was_of, reach):
            reason, new_from = "system_or_tools_changed", cur.start_of(cur.head_messages, n)
        foreign = foreign if foreign > reach else 0
    tokens = split(reason, n, hit, reach=reach, new_from=new_from, snapshots=snapshots,
                   late_reach=report.late_reach if report else 0, foreign_reach=foreign)  # fmt: skip
    evidence = {}
    if "client_rewrote" in tokens and report is not None:
        was = ""
        if decode is not None and was_of is not None and reach < len(was_of.tokens):
            was = decode(list(was_of.tokens[reach : reach + 24]))[:40]
        message = report.message if report.message is not None else cur.message_at(reach)
        evidence["client_rewrote"] = Evidence(message, report.before, report.after, was)
    if "expired" in tokens and prev is not None and prev.at:
        evidence["expired"] = Evidence(pause_s=round(cur.at - prev.at, 1))
    if "template_dropped_reasoning" in tokens:
        evidence["template_dropped_reasoning"] = Evidence(cur.message_at(reach), model=req.model)
    if "checkpoint_spacing" in tokens:
        evidence["checkpoint_spacing"] = Evidence(gap=tokens["checkpoint_spacing"])
    return Loss(0.0, req.model, req.tenant, req.session or "", n, hit, tokens, evidence)


def _restamped(cur: PromptSummary, other: PromptSummary, reach: int) -> bool:
    """Whether a new session's prompt left `other`'s inside their leading system messages
    and the two re-align by the end of them: the same system prompt with a changed stamp."""
    if not cur.head_messages or cur.message_at(reach) >= cur.head_messages:
        return False
    end, other_end = cur.start_of(cur.head_messages, -1), other.start_of(other.head_messages, -1)
    if end < 0 or other_end < 0 or abs(end - other_end) > REALIGN_SLACK:
        return False
    tail = REALIGN_TOKENS
    return (
        end - tail > reach
        and cur.tokens[end - tail : end] == other.tokens[other_end - tail : other_end]
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _conversation(req: GenerationRequest) -> str:
    """A session for requests that name none: their conversation, else the request."""
    return conversation_id(req.messages) or "r-" + req.request_id
