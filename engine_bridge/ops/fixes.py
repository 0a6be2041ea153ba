"""What to change for each cause of tokens computed again (diagnosis.py), in words and,
where a setting helps, as the setting's TOML key and the value to give it.

Values come from what the window showed: a RAM budget large enough for the tokens RAM
evicted (within the memory the machine has to spare), a session TTL longer than the
pauses that outlived it, a checkpoint interval below the gaps hybrids resumed short by,
and a normalization rule whose regex matches the text a client changes each time.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..types import EngineError
from .diagnosis import Cause, Evidence, Ranked

# A volatile run of text, as clients stamp it: dates, times, counters (digits and their
# separators), else ids (letters, digits, dashes).
_NUMERIC = re.compile(r"[0-9][0-9:\-./T+Z ]*")
_WORD = re.compile(r"[\w\-]+")
_ANCHOR_CHARS = 24  # literal text before the run, to pin the rule to its place
GROWTH = 1.5  # a budget suggested for evicted tokens holds half as much again beside them


@dataclass(frozen=True, slots=True)
class Context:
    """The settings and figures a fix is worded from (Engine.diagnosis builds it)."""

    ram_budget_bytes: int
    ram_room_bytes: int | None  # what the memory guard leaves to grow into (None: unknown)
    bytes_per_token: float | None  # what RAM holds per cached token, as measured
    ssd_enabled: bool
    ssd_disabled_reason: str | None
    ssd_max_bytes: int | None
    ssd_bytes: int | None
    session_ttl_s: float | None
    ssd_ttl_s: float | None
    checkpoint_interval: int
    keep_periodic: bool
    block_size: int
    warm_ahead: bool
    shared_down: str | None = None  # why the shared tier is down, when it is
    # A model's template kwargs that keep past reasoning, where its template has such a
    # flag (Qwen3.6's preserve_thinking): the engine's defaults for it.
    keep_flags: Callable[[str], dict[str, Any]] = lambda model: {}
    tuning: dict[str, Any] | None = None  # /v1/cache/stats autotune, when on


def fix(r: Ranked, ctx: Context) -> dict[str, Any]:
    """{"text": what to do, "key": the TOML key or None, "value": its new value or None}."""
    return _FIXES.get(r.cause, _nothing)(r, ctx)


def _out(text: str, key: str | None = None, value: Any = None) -> dict[str, Any]:
    return {"text": text, "key": key, "value": value}


def _nothing(r: Ranked, ctx: Context) -> dict[str, Any]:
    return _out("nothing to change: no earlier request sent these tokens")


def _evicted(r: Ranked, ctx: Context) -> dict[str, Any]:
    if ctx.ssd_disabled_reason:
        return _out(
            f"RAM evicted {r.tokens:,} tokens while the SSD tier was disabled "
            f"({ctx.ssd_disabled_reason}): fix the disk; it resumes by itself"
        )
    # Room for what was evicted and sent again, with half again for what LRU keeps beside it.
    want = ctx.ram_budget_bytes + int(r.tokens * (ctx.bytes_per_token or 0) * GROWTH)
    if ctx.ram_room_bytes is not None:
        want = min(want, ctx.ram_budget_bytes + ctx.ram_room_bytes)
    ssd = "" if ctx.ssd_enabled else "; or turn the SSD tier on, which keeps what RAM evicts"
    tuning = ctx.tuning if ctx.tuning and ctx.tuning.get("enabled") else None
    if tuning is not None and want > ctx.ram_budget_bytes:
        # The autotuner grows the budget itself, up to its bound: the bound is the setting.
        most = tuning["bounds"]["ram_max_bytes"]
        if ctx.ram_budget_bytes < most:
            return _out(f"RAM evicted {r.tokens:,} tokens that later requests sent again: "
                        f"autotune is growing the budget (now {_size(ctx.ram_budget_bytes)}, "
                        f"at most {_size(most)}){ssd}")  # fmt: skip
        return _out(
            f"RAM evicted {r.tokens:,} tokens that later requests sent again, and autotune's "
            f"budget is at its bound: {_size(want)} would have kept them{ssd}",
            "autotune.ram_max", _size(want),
        )  # fmt: skip
    if want > ctx.ram_budget_bytes:
        return _out(
            f"RAM evicted {r.tokens:,} tokens that later requests sent again, and the SSD "
            f"did not hold them: a RAM budget of {_size(want)} would have kept them{ssd}",
            "cache.ram.budget", _size(want),
        )  # fmt: skip
    if not ctx.ssd_enabled:
        return _out(
            f"RAM evicted {r.tokens:,} tokens that later requests sent again, this machine "
            "has no memory to spare for more, and the SSD tier is off: turn it on",
            "cache.ssd.enabled", True,
        )  # fmt: skip
    return _out(
        f"RAM evicted {r.tokens:,} tokens the SSD did not hold, and this machine has no "
        "memory to spare for a larger budget: write_policy = \"through\" keeps a copy of "
        "every block on the SSD", "cache.ssd.write_policy", "through",
    )  # fmt: skip


def _evicted_ssd(r: Ranked, ctx: Context) -> dict[str, Any]:
    base = ctx.ssd_max_bytes or ctx.ssd_bytes or 0
    want = base + int(r.tokens * (ctx.bytes_per_token or 0) * GROWTH)
    return _out(
        f"the SSD tier deleted {r.tokens:,} tokens for room that later requests sent again: "
        f"give it {_size(want)}", "cache.ssd.max_size", _size(want)
    )  # fmt: skip


def _expired(r: Ranked, ctx: Context) -> dict[str, Any]:
    pauses = [e.pause_s for e in r.evidence if e.pause_s is not None]
    longest = max(pauses, default=None)
    ttls = [("cache.session_ttl", ctx.session_ttl_s), ("cache.ssd.ttl", ctx.ssd_ttl_s)]
    # The TTL the pauses outlived: the shorter one set that the longest pause passed.
    passed = [(k, t) for k, t in ttls if t is not None and (longest is None or longest >= t)]
    key, ttl = min(passed or [(k, t) for k, t in ttls if t is not None] or [ttls[0]],
                   key=lambda kt: kt[1] or math.inf)  # fmt: skip
    want = _duration(max(longest or 0.0, ttl or 0.0) * 1.5)
    paused = f" after pauses of up to {_duration(longest)}" if longest else ""
    return _out(
        f"{r.tokens:,} tokens expired before their sessions came back{paused}: "
        f"a TTL of {want} keeps them", key, want
    )  # fmt: skip


def _client_rewrote(r: Ranked, ctx: Context) -> dict[str, Any]:
    e = next((e for e in reversed(r.evidence) if e.before or e.after), None)
    if e is None:
        return _out(f"the client changed earlier messages, costing {r.tokens:,} tokens")
    where = f"message {e.message}" if e.message is not None else "an earlier message"
    said = f"{where} changed at {e.before[-20:]!r} | {e.after[:20]!r}"
    if e.was:
        said += f" (was {e.was[:20]!r})"
    rule = rule_for(e)
    if rule is None:
        return _out(f"the client rewrites {said}, costing {r.tokens:,} tokens: make it "
                    "send earlier messages unchanged")  # fmt: skip
    return _out(
        f"the client rewrites {said}, costing {r.tokens:,} tokens: this rule makes the "
        "changing text the same every time", "normalization.rules", rule
    )  # fmt: skip


def rule_for(e: Evidence) -> dict[str, Any] | None:
    """A `[[normalization.rules]]` entry for the text a client changes at the divergence:
    the volatile run around it (a date and time, a counter, an id) found in the new text
    and, where known, the old one, after the literal words that label it on its line."""
    text, at = e.before + e.after, len(e.before)
    run = _run_at(text, at)
    if run is None:
        return None
    start, end, numeric = run
    line = text.rfind("\n", 0, start) + 1
    label = text[max(line, start - _ANCHOR_CHARS) : start]
    if start - _ANCHOR_CHARS > line:  # cut mid-line: start at a word
        label = label[label.find(" ") + 1 :] if " " in label else ""
    volatile = text[start:end]
    body = re.sub(r"\d+", r"\\d+", re.escape(volatile)) if numeric else r"[\w\-]+"
    pattern = re.escape(label) + body
    old = e.before + e.was
    if e.was and not any(m.start() < at <= m.end() for m in re.finditer(pattern, old)):
        return None  # the old text must match too, or the rule would change one side only
    kind = "time" if numeric else "id"
    return {"name": f"volatile-{kind}", "pattern": pattern,
            "replacement": f"{label}<{kind}>", "roles": ["system", "user"]}  # fmt: skip


def _run_at(text: str, at: int) -> tuple[int, int, bool] | None:
    """The volatile run holding position `at` (the first changed character): digits and
    what separates them in dates and times, else a word or id; and whether it is numeric."""
    for m in _NUMERIC.finditer(text):
        if m.start() <= at <= m.end() and m.end() > m.start():
            start, end = m.span()
            # Strip what only separates: the run starts and ends on a digit.
            while start < end and not text[start].isdigit():
                start += 1
            while end > start and not text[end - 1].isdigit():
                end -= 1
            inside_word = (start > 0 and text[start - 1].isalnum()) or (
                end < len(text) and text[end].isalnum()
            )
            if start < end and not inside_word:
                return start, end, True
    for m in _WORD.finditer(text):
        if m.start() <= at < m.end():
            return m.start(), m.end(), False
    return None


def _template_dropped(r: Ranked, ctx: Context) -> dict[str, Any]:
    base = (f"the chat template drops earlier turns' reasoning when a new question comes "
            f"({r.tokens:,} tokens): ")  # fmt: skip
    for model in dict.fromkeys(e.model for e in reversed(r.evidence) if e.model):
        try:
            flags = ctx.keep_flags(model)
        except EngineError:  # no longer served
            continue
        if flags:
            names = ", ".join(f"{k} = {str(v).lower()}" for k, v in flags.items())
            return _out(
                base + f"{model}'s template keeps it with {names}, which its settings or "
                "the requests turn off", f'model."{model}".chat_template_kwargs', flags
            )  # fmt: skip
    if not ctx.warm_ahead:
        return _out(base + "warm-ahead prefills the next question's prefix while the "
                    "machine is idle", "cache.warm_ahead.enabled", True)  # fmt: skip
    return _out(
        base + "a template with a flag to keep it (Qwen3.6's preserve_thinking) should have "
        "it on in the model's chat_template_kwargs; without one, warm-ahead fills the "
        "prefix once no request has come for after_idle seconds",
        "cache.warm_ahead.after_idle", 0.5,
    )  # fmt: skip


def _template_changed(r: Ranked, ctx: Context) -> dict[str, Any]:
    return _out(f"the same messages rendered to other tokens ({r.tokens:,}): the model's "
                "chat template or its chat_template_kwargs changed between requests")  # fmt: skip


def closer_interval(gaps: list[int], interval: int, block_size: int) -> tuple[int, float]:
    """The checkpoint interval that resumes closer after `gaps` (tokens hybrids resumed
    short of where prompts diverged): the power of two at or below the typical gap, at most
    half `interval`, at least a block; and that typical gap. Autotune sets what this fix
    names (autotune.py)."""
    typical = statistics.median(gaps) if gaps else interval / 2
    return max(block_size, _pow2_below(min(typical, interval / 2))), typical


def _checkpoint_spacing(r: Ranked, ctx: Context) -> dict[str, Any]:
    gaps = [e.gap for e in r.evidence if e.gap > 0]
    want, typical = closer_interval(gaps, ctx.checkpoint_interval, ctx.block_size)
    base = (f"a hybrid model resumed {r.tokens:,} tokens before where prompts left the "
            f"cached ones (typically {typical:,.0f} tokens short): ")  # fmt: skip
    closer = {"checkpoint_interval": want} if want < ctx.checkpoint_interval else {}
    if not ctx.keep_periodic:
        # Periodic checkpoints go once a request ends: only message starts are left.
        return _out(
            base + "keep each conversation's newest periodic checkpoint"
            + (f" and take one every {want} tokens" if closer else "")
            + ", at one checkpoint more per conversation in RAM",
            "cache.ram", {"keep_periodic": True, **closer},
        )  # fmt: skip
    if not closer:
        return _out(base + "checkpoints are as close as blocks already")
    return _out(base + f"checkpoints every {want} tokens resume closer, at more RAM and SSD",
                "cache.ram.checkpoint_interval", want)  # fmt: skip


def _other(r: Ranked, ctx: Context) -> dict[str, Any]:
    return _out(
        f"another tenant or model had computed {r.tokens:,} of these tokens; tenants never "
        "share cached prefixes: clients that should share one send the same x-tenant "
        "header or API key"
    )


def _tier_fault(r: Ranked, ctx: Context) -> dict[str, Any]:
    down = [f"SSD: {ctx.ssd_disabled_reason}"] if ctx.ssd_disabled_reason else []
    down += [f"shared: {ctx.shared_down}"] if ctx.shared_down else []
    state = "; ".join(down) or "the tiers answer again now"
    return _out(f"a tier below RAM held {r.tokens:,} tokens but answered too late or was "
                f"down ({state}): see /v1/cache/stats ssd and shared")  # fmt: skip


def _bypass(r: Ranked, ctx: Context) -> dict[str, Any]:
    asked = f"{r.requests} request{'s' if r.requests != 1 else ''}"
    return _out(f"{asked} asked for no cache (x-prompt-cache: bypass), "
                f"computing {r.tokens:,} tokens")  # fmt: skip


def _unexplained(r: Ranked, ctx: Context) -> dict[str, Any]:
    return _out(f"the cache held less than these sessions stored ({r.tokens:,} tokens) and "
                "no record says why: GET /v1/cache/requests lists them")  # fmt: skip


_FIXES = {
    "evicted": _evicted,
    "evicted_ssd": _evicted_ssd,
    "expired": _expired,
    "client_rewrote": _client_rewrote,
    "template_dropped_reasoning": _template_dropped,
    "template_changed": _template_changed,
    "checkpoint_spacing": _checkpoint_spacing,
    "other_tenant_or_model": _other,
    "tier_fault": _tier_fault,
    "bypass": _bypass,
    "unexplained": _unexplained,
}
_: dict[Cause, Any] = _FIXES  # every key is a cause


def _pow2_below(n: float) -> int:
    return 1 << max(int(math.log2(max(n, 1))), 0)


def _size(n: int) -> str:
    """Bytes as the config reads them, rounded up: "3GB", "750MB"."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6)):
        if n >= scale:
            return f"{math.ceil(n / scale)}{unit}"
    return f"{max(math.ceil(n / 10**3), 1)}KB"


def _duration(seconds: float | None) -> str:
    """Seconds as the config reads them, rounded up to a minute or an hour: "45m", "3h"."""
    s = max(seconds or 0.0, 60.0)
    if s >= 3 * 3600:
        return f"{math.ceil(s / 3600)}h"
    return f"{math.ceil(s / 60)}m"
