"""The dashboard's alerts banner and Autotune card in Chromium, driven as test_dashboard.py
drives the page, against one real proxy with 300 KB of RAM: two projects' conversations
take turns (evicted blocks come back, the tuner grows the budget), and a client rewrites
the time stamp in its system prompt (an alert names it). The page shows what
GET /v1/cache/stats reports."""

from __future__ import annotations

from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal
from typing import TYPE_CHECKING

import pytest

from proxy.config.tomltext import inline
from tests.cache.test_autotune import SSD_OFF, projects
from tests.cache.test_cache_requests import LLAMA
from tests.cache.test_diagnosis import stamped_turns
from tests.cache_api.test_dashboard import (
    WAIT_MS,
    api,
    browser_fixture,  # noqa: F401 (the `browser` fixture)
    needs_browser,
    page_fixture,  # noqa: F401 (the `page` fixture)
    text,
    until,
)
from tests.conftest import Server, fresh_cache_dir, start_server

if TYPE_CHECKING:  # the test extras bring Playwright; without it these tests skip
    from playwright.sync_api import Page

# Looks every second: the tuner at its RAM tier, the alerts at the diagnosis (from 100
# tokens lost on, where the default waits for 4,096).
CONFIG = '[autotune]\ninterval = "1s"\n[alerts]\nmin_tokens = 100\ninterval = "1s"\n'


@pytest.fixture(scope="module")
def tuned(demo_root, tmp_path_factory) -> Iterator[Server]:
    """The proxy after six rounds of the two projects (tests/cache/test_autotune.py)."""
    cache = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("tuned-cache"))
    config = cache / "tuned.toml"
    config.write_text(CONFIG)
    server = start_server(cache, "--config", str(config), "--model", LLAMA,
                          "--ram-budget", "300000", "--upstream", "http://127.0.0.1:9",
                          env=SSD_OFF)  # fmt: skip
    try:
        projects(server, 6)
        yield server
    finally:
        server.stop()


def settled(page: Page, shown, wanted, what: str):
    """What the page shows once it equals what the API says now (both move while the
    server works); if they never meet, the last pair is asserted equal, for its diff."""
    for _ in range(WAIT_MS // 100):
        got, want = shown(), wanted()
        if got == want:
            return got
        page.wait_for_timeout(100)
    assert got == want, what


def alerts_shown(page: Page) -> list:
    return page.eval_on_selector_all(
        "#alerts-list li",
        """els => els.map(li => [li.dataset.key, li.querySelector('.message').textContent,
            (li.querySelector('code.setting') || li.querySelector('.fix') || {}).textContent])""",
    )


def alerts_wanted(alerts: list[dict]) -> list:
    """Each alert as the banner writes it: its message, and its fix as the setting in TOML
    where a setting fixes it, else the fix's words."""

    def fix(f: dict | None) -> str | None:
        if not f:
            return None
        return f"{f['key']} = {inline(f['value'])}" if f["key"] else f["text"] or None

    return [[a["key"], f"⚠ {a['message']}", fix(a["fix"])] for a in alerts]


def size(n: int) -> str:
    """A byte count as the page writes it (format.js `bytes`; toFixed rounds a tie up)."""
    units, x, i = ["B", "KB", "MB", "GB", "TB"], n, 0
    while x >= 1000 and i < len(units) - 1:
        x, i = x / 1000, i + 1
    return (
        f"{n} B" if i == 0 else f"{Decimal(x).quantize(Decimal('0.1'), ROUND_HALF_UP)} {units[i]}"
    )


def js(v) -> str:
    """A number or flag as JavaScript's String() writes it (0.0 is "0")."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(int(v)) if float(v).is_integer() else repr(v)


def autotune_shown(page: Page) -> dict:
    return page.eval_on_selector(
        "#autotune-card",
        """card => {
          const text = (id) => card.querySelector("#" + id).textContent;
          const bar = (id) => ["min", "max", "value"].map((k) => card.querySelector("#" + id)[k]);
          return {
            value: text("autotune"), budget: text("autotune-budget"),
            budget_bar: bar("autotune-budget-meter"), protect: text("autotune-protect"),
            protect_bar: bar("autotune-protect-meter"), periodic: text("autotune-periodic"),
            interval: text("autotune-interval"),
            ghosts: text("autotune-ghosts"),
            changes: [...card.querySelectorAll("#autotune-changes li")].map((li) => [
              li.dataset.setting, Number(li.dataset.time),
              li.querySelector(".change").textContent, li.querySelector(".why").textContent]),
          };
        }""",
    )


def autotune_wanted(auto: dict) -> dict:
    """The card as the server's `autotune` stats make it: the last ten changes newest first,
    the budget's values as sizes."""
    b, g = auto["bounds"], auto["ghost_hits"]
    shown = lambda c, v: size(v) if c["setting"] == "cache.ram.budget" else js(v)  # noqa: E731
    return {
        "value": "on",
        "budget": f"{size(auto['ram_budget_bytes'])} (bounds {size(b['ram_min_bytes'])} – "
        f"{size(b['ram_max_bytes'])})",
        "budget_bar": [b["ram_min_bytes"], b["ram_max_bytes"], auto["ram_budget_bytes"]],
        "protect": f"{js(auto['protect_frequent'])} (0 – {js(b['protect_frequent_max'])})",
        "protect_bar": [0, b["protect_frequent_max"], auto["protect_frequent"]],
        "periodic": js(auto["keep_periodic"]),
        "interval": f"{auto['checkpoint_interval']:,} tokens "
        f"(least {b['checkpoint_interval_min']:,})",
        "ghosts": f"{size(g['came_back_bytes'])}: {g['frequent']:,} entries read before, "
        f"{g['recent']:,} never read",
        "changes": [
            [c["setting"], c["time"], f"{shown(c, c['from'])} → {shown(c, c['to'])}", c["reason"]]
            for c in reversed(auto["changes"][-10:])
        ],
    }


@needs_browser
def test_autotune_card_shows_the_budget_in_its_bounds_and_the_changes_the_server_made(tuned, page):
    """The tuner grew the budget while evicted blocks came back; the card shows each
    setting against its bounds and the last changes, newest first, as the server lists
    them."""
    auto = lambda: api(tuned, "/v1/cache/stats")["autotune"]  # noqa: E731
    grew = [c for c in auto()["changes"] if c["setting"] == "cache.ram.budget"]
    assert grew and grew[0]["from"] == 300_000 < grew[0]["to"], auto()
    page.goto(tuned.url + "/dashboard")
    card = settled(page, lambda: autotune_shown(page), lambda: autotune_wanted(auto()), "card")
    assert card["budget"].endswith("(bounds 300.0 KB – 600.0 KB)")
    rows = [(setting, change) for setting, _, change, _ in card["changes"]]
    assert ("cache.ram.budget", "300.0 KB → 375.0 KB") in rows, rows
    assert page.locator("#autotune-card").is_visible()
    assert text(page, "#autotune-detail").startswith("tuned by load; last change ")
    assert page.problems == []


@needs_browser
def test_alerts_banner_lists_the_alerts_on_with_their_fixes(tuned, page):
    """A client that rewrites the time stamp in its system prompt raises an alert naming
    client_rewrote; the banner lists every alert the server has on (the evictions' too),
    each with its fix: the normalization rule to paste for this one."""
    stamped_turns(tuned, "dash-alerting")
    on = lambda: api(tuned, "/v1/cache/stats")["alerts"]  # noqa: E731
    page.goto(tuned.url + "/dashboard")

    def rule() -> list:
        return [(a["fix"] or {}).get("key") for a in on() if a["key"] == "client_rewrote"]

    # The two projects' prompts already read as a rewrite, with no rule to offer; the fix
    # follows the latest rewrite, the time stamp's, from the alerts' next look on.
    until(lambda: rule() == ["normalization.rules"], "the client_rewrote alert's rule", page)
    shown = settled(page, lambda: alerts_shown(page), lambda: alerts_wanted(on()), "the banner")
    assert page.locator("#alerts").is_visible()
    rewrote = next(fix for key, _, fix in shown if key == "client_rewrote")
    assert rewrote.startswith("normalization.rules = { ") and "Current time:" in rewrote
    assert page.problems == []
