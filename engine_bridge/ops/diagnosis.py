"""Every prompt token computed again, by cause, over a sliding window; and what to change.

A request that used the cache computed `prompt - hit` tokens (never fewer than one: the
last prompt token always runs). Each of them gets one cause, from what the request log
knows of it: the session's previous prompt (how far the two agree, and which message
moved), the tiers' eviction records (`LookupReport.lost`), the read-ahead (`late`), and
the model's resume points (a hybrid model resumes only at its checkpoints). So the tokens
by cause add up to the tokens computed again, request by request.

- `new_content`: tokens no request sent before (a new question, tool results): nothing to do;
- `evicted`: RAM dropped them for room and the SSD did not have them: capacity;
- `evicted_ssd`: the SSD dropped them too (its `max_size`);
- `expired`: a TTL dropped them (the session's, or the SSD's);
- `client_rewrote`: the client changed an earlier message (a time stamp in the system
  prompt, a reordered tool list): the message, the text where it changed, and a
  `[[normalization.rules]]` regex that would keep the prefix;
- `template_dropped_reasoning`: a new question made the template render earlier turns
  without their reasoning;
- `template_changed`: the same messages rendered to other tokens (a changed template or
  its options);
- `checkpoint_spacing`: a hybrid model resumed at a checkpoint before the point where the
  prompt left the cached one;
- `other_tenant_or_model`: another tenant or model had computed the prefix (they never share);
- `tier_fault`: a tier below RAM held it but answered too late (or was down);
- `bypass`: the request asked for no cache;
- `unexplained`: the cache held less than the session stored, and no record says why.

`Diagnosis.report` ranks the causes of a window (all requests, or one model, tenant or
session) with their tokens, share and fix; `fixes.py` words each fix from the settings.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..types import Cause

# The request log's reason class → the cause of the tokens between the hit and where the
# prompt left what the cache had seen.
_BY_REASON: dict[str, Cause] = {
    "evicted_ram": "evicted",
    "evicted_ssd": "evicted_ssd",
    "expired": "expired",
    "tier_late": "tier_fault",
    "partial": "unexplained",
    "history_edited": "client_rewrote",
    "system_or_tools_changed": "client_rewrote",
    "history_rewritten": "template_dropped_reasoning",
    "template_changed": "template_changed",
}
# Causes worth an alert and a fix: every one but new content, which nothing changes.
ACTIONABLE: frozenset[Cause] = frozenset(_BY_REASON.values()) | {
    "checkpoint_spacing",
    "other_tenant_or_model",
    "bypass",
}
WINDOW_S = 3600.0  # the default window: the last hour
MAX_ENTRIES = 5000  # and at most this many requests in it


@dataclass(frozen=True, slots=True)
class Evidence:
    """What one request showed of a cause, for its fix: where a client rewrote a message
    (the text before and after the point, new and old), how long the session paused before
    an expiry, how far a hybrid model resumed before the divergence."""

    message: int | None = None
    before: str = ""
    after: str = ""
    was: str = ""  # the old text after the point
    pause_s: float | None = None
    gap: int = 0
    model: str = ""  # whose template dropped reasoning


@dataclass(frozen=True, slots=True)
class Loss:
    """One request's tokens computed again, by cause (they add up to prompt - hit)."""

    time: float  # unix seconds
    model: str
    tenant: str
    session: str
    prompt_tokens: int
    hit_tokens: int
    tokens: dict[Cause, int]
    evidence: dict[Cause, Evidence] = field(default_factory=dict)

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.hit_tokens


def split(
    reason: str,
    prompt_tokens: int,
    hit: int,
    *,
    reach: int,
    new_from: int,
    snapshots: bool,
    late_reach: int = 0,
    foreign_reach: int = 0,
) -> dict[Cause, int]:
    """The `prompt_tokens - hit` tokens a request computed, by cause.

    `reason`: the request log's class. `reach`: how far the prompt agreed with what the
    cache had seen of it (the session's previous prompt, or the nearest other session's).
    `new_from`: where the messages that previous prompt did not have begin (the end of the
    leading system messages for a new session): a rewrite costs the tokens from the
    divergence to there, the rest is new. `snapshots`: a model that resumes only at its
    checkpoints (tokens between the hit and the divergence are then the spacing's).
    `foreign_reach`: how far another tenant's or model's prompt agreed with this one.
    """
    computed = max(prompt_tokens - hit, 0)
    out: Counter[Cause] = Counter()
    if reason == "bypass":
        out["bypass"] = computed
        return _done(out, computed)
    last = max(prompt_tokens - 1, 0)
    reach = min(reach, last)
    cause = _BY_REASON.get(reason)
    if cause in ("client_rewrote", "template_dropped_reasoning", "template_changed"):
        # A rewrite: resumed before the divergence (the spacing's, on a hybrid model),
        # then everything the old prompt had from there on is computed again.
        gap = max(reach - hit, 0)
        out["checkpoint_spacing" if snapshots else cause] += gap
        out[cause] += max(min(new_from, prompt_tokens) - max(hit, reach), 0)
    elif cause is not None:  # dropped or late: what the cache had seen, up to its reach
        out[cause] += max(max(reach, late_reach if cause == "tier_fault" else 0) - hit, 0)
    elif reason == "new_session" and foreign_reach > hit:
        out["other_tenant_or_model"] += min(foreign_reach, last) - hit
    elif snapshots and reach > hit:
        # The cache had seen this prefix but holds no checkpoint at it (a new session's
        # shared system prompt, or a hit short of where the session's prompt ended).
        out["checkpoint_spacing"] += reach - hit
    return _done(out, computed)


def _done(out: Counter[Cause], computed: int) -> dict[Cause, int]:
    """`out` fitted to `computed` tokens: the rest is new content; never more than computed."""
    kept: dict[Cause, int] = {}
    left = computed
    for cause, n in out.items():
        n = min(n, left)
        if n > 0:
            kept[cause] = n
            left -= n
    if left:
        kept["new_content"] = kept.get("new_content", 0) + left
    return kept


class Diagnosis:
    """The losses of the last `window_s` seconds (at most `max_entries` requests);
    filled on the MLX thread, read on the event loop."""

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = MAX_ENTRIES):
        self.window_s = window_s
        self._losses: deque[Loss] = deque(maxlen=max_entries)
        self._totals: Counter[tuple[str, Cause]] = Counter()  # since start, for /metrics
        self._lock = threading.Lock()

    def add(self, loss: Loss) -> None:
        with self._lock:
            self._losses.append(loss)
            for cause, n in loss.tokens.items():
                self._totals[loss.model, cause] += n

    def totals(self) -> dict[tuple[str, Cause], int]:
        """Tokens computed again by (model, cause) since start."""
        with self._lock:
            return dict(self._totals)

    def losses(
        self,
        window_s: float | None = None,
        *,
        model: str | None = None,
        tenant: str | None = None,
        session: str | None = None,
        now: float | None = None,
    ) -> list[Loss]:
        since = (now or time.time()) - (self.window_s if window_s is None else window_s)
        with self._lock:
            every = list(self._losses)
        return [
            x for x in every
            if x.time >= since
            and (model is None or x.model == model)
            and (tenant is None or x.tenant == tenant)
            and (session is None or x.session == session)
        ]  # fmt: skip


@dataclass(slots=True)
class Ranked:
    """One cause over a window: its tokens, share of the tokens computed again, the
    requests it cost, and the evidence of the newest of them."""

    cause: Cause
    tokens: int = 0
    requests: int = 0
    evidence: list[Evidence] = field(default_factory=list)

    def to_json(self, computed: int) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "tokens": self.tokens,
            "share": round(self.tokens / computed, 4) if computed else 0.0,
            "requests": self.requests,
        }


def rank(losses: Iterable[Loss]) -> tuple[list[Ranked], int, int]:
    """The causes of `losses`, most tokens first; and the prompt tokens and the tokens
    computed again they add up to."""
    by: dict[Cause, Ranked] = {}
    prompt = computed = 0
    for loss in losses:
        prompt += loss.prompt_tokens
        computed += loss.computed
        for cause, n in loss.tokens.items():
            r = by.setdefault(cause, Ranked(cause))
            r.tokens += n
            r.requests += 1
            if cause in loss.evidence:
                r.evidence.append(loss.evidence[cause])
    ranked = sorted(by.values(), key=lambda r: (-r.tokens, r.cause))
    return ranked, prompt, computed
