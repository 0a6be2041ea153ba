"""Alerts that say what to do: every `interval` the diagnosis of the last `window` is read
(GET /v1/cache/diagnosis's answer); an alert is raised when its hit ratio falls below
[cache] alert_hit_ratio or one cause of lost tokens passes `cause_share`, each naming the
cause and its fix, and cleared when the cause goes. Each notice goes to the log and, with
`[alerts] webhook`, to the webhook as JSON. Rate-limited: an alert that clears and comes
back within `repeat` of its last notice stays on without a second one. /v1/cache/stats
lists the alerts on now (`alerts`).

A webhook that fails or hangs costs a log line, never a request: it is posted from this
task with a short timeout, and its failures are rate-limited by the alerts themselves.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

from ..state import ENGINE, SETTINGS, AlertRules

log = logging.getLogger(__name__)

HIT_RATIO = "hit_ratio"
Event = Literal["raised", "cleared"]
# A cause clears below this fraction of the share that raised it: no flapping at the line.
CLEAR_AT = 0.5


@dataclass(slots=True)
class Alert:
    key: str  # "hit_ratio", or the cause
    cause: str | None  # the cause it names (for the hit ratio: the top one)
    message: str
    fix: dict[str, Any] | None
    since: float  # unix seconds
    share: float | None = None
    hit_ratio: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class AlertSettings:
    hit_ratio: float = 0.5  # 0: no hit-ratio alert
    cause_share: float = 0.3  # 0: no alert by cause
    min_tokens: int = 4096  # a window losing fewer tokens raises nothing
    min_requests: int = 3
    repeat_s: float = 900.0


class Alerts:
    def __init__(self, settings: AlertSettings = AlertSettings()):
        self.settings = settings
        self._active: dict[str, Alert] = {}
        self._noticed: dict[str, float] = {}  # key -> when its last notice went out

    def active(self) -> list[dict[str, Any]]:
        return [a.to_json() for a in self._active.values()]

    def check(self, report: dict[str, Any], now: float) -> list[tuple[Event, Alert]]:
        """The alerts `report` raises and clears; the events to deliver (rate-limited)."""
        wanted = dict(self._wanted(report, now))
        events: list[tuple[Event, Alert]] = []
        for key, alert in wanted.items():
            if key in self._active:
                kept = self._active[key]
                kept.message, kept.fix = alert.message, alert.fix
                kept.share, kept.hit_ratio, kept.cause = alert.share, alert.hit_ratio, alert.cause
                continue
            self._active[key] = alert
            if now - self._noticed.get(key, -1e18) >= self.settings.repeat_s:
                self._noticed[key] = now
                events.append(("raised", alert))
        for key in [k for k in self._active if k not in wanted and self._cleared(k, report)]:
            alert = self._active.pop(key)
            if self._noticed.get(key) is not None:
                events.append(("cleared", alert))
        return events

    def _wanted(self, report: dict[str, Any], now: float):
        s = self.settings
        computed = report.get("computed_tokens") or 0
        if report.get("requests", 0) < s.min_requests or computed < s.min_tokens:
            return
        causes = [c for c in report.get("causes", []) if c.get("actionable")]
        ratio = report.get("hit_ratio")
        if s.hit_ratio > 0 and ratio is not None and ratio < s.hit_ratio:
            top = causes[0] if causes else None
            why = f"; most lost to {_named(top)}" if top else "; the prompts are new content"
            yield HIT_RATIO, Alert(
                HIT_RATIO, top["cause"] if top else None,
                f"prompt cache hit ratio {ratio:.0%} is below {s.hit_ratio:.0%} over "
                f"{report['requests']} requests{why}", top["fix"] if top else None, now,
                top["share"] if top else None, ratio,
            )  # fmt: skip
        if s.cause_share <= 0:
            return
        for c in causes:
            if c["share"] >= s.cause_share:
                yield c["cause"], Alert(
                    c["cause"], c["cause"], f"{_named(c)} of the last {report['requests']} "
                    "requests' prompt tokens", c["fix"], now, c["share"], ratio,
                )  # fmt: skip

    def _cleared(self, key: str, report: dict[str, Any]) -> bool:
        """Whether an active alert's cause is gone (with some slack below its line)."""
        if key == HIT_RATIO:
            ratio = report.get("hit_ratio")
            return ratio is None or ratio >= self.settings.hit_ratio
        share = next((c["share"] for c in report.get("causes", []) if c["cause"] == key), 0.0)
        return share < self.settings.cause_share * CLEAR_AT


def _named(cause: dict[str, Any]) -> str:
    text = (cause.get("fix") or {}).get("text") or ""
    return f"{cause['cause']} ({cause['share']:.0%}: {text})"


ALERTS = web.AppKey("alerts", Alerts)
WEBHOOK_TIMEOUT_S = 5.0


def setup_alerts(app: web.Application) -> None:
    rules: AlertRules = app[SETTINGS].alerts
    app[ALERTS] = Alerts(
        AlertSettings(
            hit_ratio=rules.hit_ratio,
            cause_share=rules.cause_share,
            min_tokens=rules.min_tokens,
            repeat_s=rules.repeat_s,
        )
    )

    async def watching(app: web.Application):
        task = asyncio.create_task(watch(app))
        yield
        task.cancel()

    app.cleanup_ctx.append(watching)


def active(app: web.Application) -> list[dict[str, Any]]:
    """The alerts on now (for /v1/cache/stats)."""
    alerts = app.get(ALERTS)
    return alerts.active() if alerts is not None else []


async def watch(app: web.Application) -> None:
    rules: AlertRules = app[SETTINGS].alerts
    while True:
        await asyncio.sleep(rules.interval_s)
        try:
            await check(app)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not stop the watch, nor any request
            log.exception("reading the diagnosis for alerts failed")


async def check(app: web.Application) -> list[tuple[str, Alert]]:
    """One look at the diagnosis; the notices it gave, delivered."""
    rules: AlertRules = app[SETTINGS].alerts
    engine = app[ENGINE]
    report = await asyncio.to_thread(engine.diagnosis, rules.window_s)
    events = app[ALERTS].check(report, time.time())
    for event, alert in events:
        if event == "raised":
            log.warning("alert %s: %s; fix: %s", alert.key, alert.message, _fix(alert))
        else:
            log.info("alert cleared: %s", alert.key)
    if rules.webhook and events:
        await post(rules.webhook, events)
    return events


async def post(url: str, events: list[tuple[str, Alert]]) -> None:
    timeout = aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_S)
    host = socket.gethostname()
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for event, alert in events:
                body = {"source": "mlx-prompt-cache", "host": host, "event": event,
                        "alert": alert.to_json()}  # fmt: skip
                async with session.post(url, json=body) as r:
                    if r.status >= 400:
                        log.warning("alert webhook %s answered %d", url, r.status)
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        log.warning("alert webhook %s failed: %s", url, e or type(e).__name__)


def _fix(alert: Alert) -> str:
    fix = alert.fix or {}
    if fix.get("key"):
        return f"{fix['key']} = {fix['value']!r} ({fix.get('text', '')})"
    return fix.get("text") or "none"
