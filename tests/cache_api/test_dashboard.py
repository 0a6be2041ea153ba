"""GET /dashboard: its files and headers over HTTP, and the page itself in a real headless
Chromium (Debian's `chromium`, driven by Playwright) against a real proxy and SDK traffic.
The Autotune card and the alerts banner under load: test_dashboard_tuning.py."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from decimal import ROUND_HALF_UP, Decimal

import httpx
import openai
import pytest

from engine_bridge.engine import Engine, EngineSettings
from proxy.app import create_app
from proxy.cache_api import dashboard
from proxy.config.model import UpstreamConfig
from proxy.config.tomltext import inline
from proxy.security import browser_policy
from proxy.state import ProxySettings
from tests.conftest import Server, fresh_cache_dir, start_server
from tests.support import required

CHROMIUM = shutil.which("chromium")
try:
    from playwright.sync_api import Browser, Page, sync_playwright
except ImportError:  # the test extras bring it
    sync_playwright = None

if CHROMIUM is None:
    NO_BROWSER = required.reason(
        "no chromium on PATH: these tests drive Debian's chromium (apt-get install chromium; "
        ".ci/run installs it), not a browser Playwright downloads"
    )
elif sync_playwright is None:
    NO_BROWSER = required.reason(
        "the playwright package is not installed (pip install -e '.[test]')"
    )
else:
    NO_BROWSER = ""
needs_browser = pytest.mark.skipif(bool(NO_BROWSER), reason=NO_BROWSER or "-")
WAIT_MS = 15_000  # the page polls every 2 s
KEY = "sk-dashboard-test"


# ---------------------------------------------------------------------------------------
# Files and headers, no browser


@pytest.fixture
async def app_client(aiohttp_client, demo_root, tmp_path):
    """The app in-process; `keyed=True` serves it as an exposed server with an API key."""

    async def make(keyed: bool = False):
        engine = Engine(
            EngineSettings(
                cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
                model_specs=["demo-llama"],
                ssd_enabled=False,
            )
        )
        policy = browser_policy("0.0.0.0", api_keys=[KEY]) if keyed else None
        settings = ProxySettings(tenant_api_keys={KEY: "team"} if keyed else {})
        app = create_app(engine, settings, UpstreamConfig(enabled=False), policy)
        return await aiohttp_client(app)

    return make


async def test_page_and_every_file_it_loads_are_served_with_a_same_origin_csp(app_client):
    client = await app_client()
    r = await client.get("/dashboard")
    assert r.status == 200
    assert r.headers["Content-Type"] == "text/html; charset=utf-8"
    assert r.headers["Content-Security-Policy"] == dashboard.CSP
    assert "default-src 'none'" in dashboard.CSP and "'unsafe-inline'" not in dashboard.CSP
    html = await r.text()
    loaded = re.findall(r'(?:src|href)="/dashboard/([^"]+)"', html)
    assert sorted(loaded) == [
        "alerts.js",
        "autotune.js",
        "dashboard.css",
        "dashboard.js",
        "format.js",
        "lost.js",
        "uPlot.LICENSE",
        "uPlot.iife.min.js",
        "uPlot.min.css",
    ]
    assert "<script>" not in html and "style=" not in html  # nothing inline for the CSP to block
    types = {".js": "text/javascript", ".css": "text/css"}
    for name in loaded:
        r = await client.get(f"/dashboard/{name}")
        assert r.status == 200, name
        assert r.headers["Content-Type"].startswith(types.get(name[name.rfind(".") :], "text/"))
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Content-Security-Policy"] == dashboard.CSP
        assert await r.read() == dashboard.ASSETS[name].read_bytes()


async def test_unknown_file_is_a_404_naming_the_files_and_paths_never_reach_the_disk(app_client):
    client = await app_client()
    r = await client.get("/dashboard/secrets.txt")
    assert r.status == 404
    error = (await r.json())["error"]
    assert error["param"] == "asset"
    assert "'secrets.txt'" in error["message"] and "dashboard.js" in error["message"]
    # index.html is the page, not an asset; encoded dots and slashes stay inside one name.
    for path in ("/dashboard/index.html", "/dashboard/..%2Fdashboard.py", "/dashboard/%2e%2e"):
        assert (await client.get(path)).status == 404, path


def test_every_dashboard_file_is_in_the_package_data():
    """An installed proxy (not an editable checkout) serves the page only if they ship."""
    import tomllib
    from fnmatch import fnmatch

    from tests.conftest import REPO

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["proxy"]
    root = REPO / "proxy"
    files = [p.relative_to(root).as_posix() for p in dashboard.STATIC.rglob("*") if p.is_file()]
    assert len(files) == len(dashboard.ASSETS) + 1  # the page, and every served file
    assert [f for f in files if not any(fnmatch(f, g) for g in globs)] == []


def test_the_page_names_every_miss_reason_the_request_log_gives():
    """A reason the page has no words for shows as its raw name in the requests table."""
    from typing import get_args

    from engine_bridge.types import MissReason

    script = (dashboard.STATIC / "dashboard.js").read_text(encoding="utf-8")
    table = script[script.index("const REASONS = {") : script.index("};", script.index("REASONS"))]
    named = set(re.findall(r"^\s*(\w+):", table, re.MULTILINE))
    assert named == set(get_args(MissReason))


def test_the_page_names_every_cause_the_diagnosis_gives():
    """A cause the Lost tokens card has no words for shows as its raw name."""
    from typing import get_args

    from engine_bridge.ops.diagnosis import Cause

    script = (dashboard.STATIC / "lost.js").read_text(encoding="utf-8")
    table = script[script.index("const CAUSES = {") : script.index("};", script.index("CAUSES"))]
    named = set(re.findall(r"^\s*(\w+):", table, re.MULTILINE))
    assert named == set(get_args(Cause))


async def test_page_loads_without_a_key_but_its_data_and_the_passthrough_need_one(app_client):
    client = await app_client(keyed=True)
    assert (await client.get("/dashboard")).status == 200
    assert (await client.get("/dashboard/dashboard.js")).status == 200
    assert (await client.get("/v1/cache/stats")).status == 401
    # Under /dashboard/ but not a dashboard route: the passthrough's, so a key is wanted.
    assert (await client.get("/dashboard/a/b")).status == 401
    keyed = {"Authorization": f"Bearer {KEY}"}
    assert (await client.get("/v1/cache/stats", headers=keyed)).status == 200


# ---------------------------------------------------------------------------------------
# The page in Chromium


@pytest.fixture(scope="module")
def live(demo_root, tmp_path_factory) -> Iterator[Server]:
    """A proxy of its own: the tests delete sessions and drive the hit ratio down. Its
    settings are fixed: no autotune."""
    cache = fresh_cache_dir(demo_root, tmp_path_factory.mktemp("dashboard-cache"))
    config = cache / "dashboard.toml"
    config.write_text("[autotune]\nenabled = false\n")
    server = start_server(cache, "--config", str(config), "--upstream", "http://127.0.0.1:9")
    yield server
    server.stop()


@pytest.fixture(scope="module", name="browser")
def browser_fixture() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM)
        yield b
        b.close()


@pytest.fixture(name="page")
def page_fixture(browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    # Everything the page or the CSP complained about (502s of routes the test did not
    # expect are "Failed to load resource" lines; those are for the test to judge).
    pg.problems = []
    pg.requested = []  # every URL the page fetched, to see it asks nothing of anyone else
    pg.on("request", lambda r: pg.requested.append(r.url))
    pg.on("pageerror", lambda e: pg.problems.append(f"page error: {e}"))
    pg.on(
        "console",
        lambda m: pg.problems.append(m.text) if "Content Security Policy" in m.text else None,
    )
    yield pg
    context.close()


# Waits are polled from here, not with wait_for_function: that evaluates a string in the
# page, which the page's own CSP (no 'unsafe-eval') rightly refuses.
def until(check, what: str, page: Page) -> None:
    for _ in range(WAIT_MS // 100):
        if check():
            return
        page.wait_for_timeout(100)
    raise AssertionError(f"gave up after {WAIT_MS} ms waiting for {what}")


def polled(page: Page, at_least: int) -> None:
    polls = lambda: int(page.get_attribute("body", "data-polls") or 0)  # noqa: E731
    until(lambda: polls() >= at_least, f"poll {at_least}", page)


def next_poll(page: Page) -> None:
    polled(page, int(page.get_attribute("body", "data-polls") or 0) + 1)


def text(page: Page, selector: str) -> str:
    return page.inner_text(selector).strip()


def chat(
    server: Server, content: str, session: str, system: str = "You are terse.", max_tokens: int = 1
) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    client.chat.completions.create(
        model="demo-llama",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"x-session-id": session},
    )


def api(server: Server, path: str) -> dict:
    r = httpx.get(server.url + path, timeout=30)
    assert r.status_code == 200, f"GET {path}: {r.status_code} {r.text[:300]}"
    return r.json()


@needs_browser
def test_numbers_change_after_a_request(live, page):
    page.goto(live.url + "/dashboard")
    polled(page, 1)
    before = api(live, "/v1/cache/stats")["requests"]["total"]
    assert before == 0  # the first test on this server
    assert page.locator("#alerts").is_hidden()  # none on before any request
    assert (text(page, "#requests"), text(page, "#hit-ratio")) == ("0", "–")
    prompt = "Tell me about prompt caches. " * 12
    # Three tokens each: the prefill writes the first, decode steps the others.
    chat(live, prompt, "dash-numbers", max_tokens=3)
    chat(live, prompt, "dash-numbers", max_tokens=3)
    until(lambda: text(page, "#requests") == str(before + 2), "2 more requests", page)
    stats = api(live, "/v1/cache/stats")
    assert stats["requests"]["cached_tokens"] > 0
    assert text(page, "#hit-ratio") == f"{stats['hit_ratio'] * 100:.0f}%"
    assert text(page, "#hit-detail") == (
        f"{stats['requests']['cached_tokens']:,} of {stats['requests']['prompt_tokens']:,} "
        "prompt tokens from cache"
    )
    assert text(page, "#ram") != "0 B"
    # Decode speed in model steps: tokens per step (above 1 where speculation kept drafts).
    assert stats["scheduler"]["decode_steps"] > 0
    assert text(page, "#spec") == f"{stats['scheduler']['tokens_per_step']:.2f}"
    assert f"of {stats['ssd']['max_bytes'] / 1e9:.1f} GB max" in text(page, "#ssd-detail")
    # The recent requests table, newest first, with why each one hit or missed.
    recent = api(live, "/v1/cache/requests?limit=2")["requests"]
    page.wait_for_selector(f'#recent tr[data-id="{recent[0]["id"]}"]', timeout=WAIT_MS)
    reasons = page.eval_on_selector_all(
        "#recent tbody span.reason", "els => els.slice(0, 2).map(e => e.dataset.reason)"
    )
    assert reasons == [r["reason"] for r in recent]
    assert reasons[1] == "new_session"
    assert page.problems == []
    # Only this server, only the dashboard's files and the cache routes.
    paths = {httpx.URL(u).path for u in page.requested}
    assert {u for u in page.requested if not u.startswith(live.url + "/")} == set()
    assert {p for p in paths if not p.startswith(("/dashboard", "/v1/cache/"))} == set()
    # Nor does the browser itself ask for /favicon.ico, which would go to the upstream
    # (Playwright does not report that request; the server's log does).
    assert "GET /favicon.ico" not in live.log()


@needs_browser
def test_delete_and_pin_a_session_through_its_buttons(live, page):
    system = "You are a careful assistant. " * 20  # the prefix both sessions share
    chat(live, "first question, kept", "dash-keep", system)
    chat(live, "second question, dropped", "dash-drop", system)
    kept_before = {s["id"]: s for s in api(live, "/v1/cache/sessions")["sessions"]}["dash-keep"]
    page.goto(live.url + "/dashboard")
    row = page.locator('#sessions tr[data-id="dash-drop"]')
    row.wait_for(timeout=WAIT_MS)
    delete = row.locator('button[data-action="delete"]')
    delete.click()
    assert delete.inner_text() == "Confirm delete"  # one click arms it; nothing is gone yet
    assert "dash-drop" in {s["id"] for s in api(live, "/v1/cache/sessions")["sessions"]}
    delete.click()
    row.wait_for(state="detached", timeout=WAIT_MS)
    assert text(page, "#flash").startswith("deleted dash-drop (")
    sessions = {s["id"]: s for s in api(live, "/v1/cache/sessions")["sessions"]}
    assert "dash-drop" not in sessions
    assert sessions["dash-keep"]["tokens"] == kept_before["tokens"]  # the shared prefix stays

    keep = page.locator('#sessions tr[data-id="dash-keep"]')
    keep.locator('button[data-action="pin"]').click()
    keep.locator('button[data-action="unpin"]').wait_for(timeout=WAIT_MS)
    assert text(page, "#flash") == "dash-keep pinned"
    assert {s["id"]: s for s in api(live, "/v1/cache/sessions")["sessions"]}["dash-keep"]["pinned"]
    keep.locator('button[data-action="unpin"]').click()
    keep.locator('button[data-action="pin"]').wait_for(timeout=WAIT_MS)
    sessions = {s["id"]: s for s in api(live, "/v1/cache/sessions")["sessions"]}
    assert sessions["dash-keep"]["pinned"] is False
    assert page.problems == []


@needs_browser
def test_a_session_id_full_of_markup_is_shown_as_text_and_deleted_by_its_button(live, page):
    hostile = """<img src=x onerror="document.title='owned'"> & "quotes" 'too' %2e%2e"""
    chat(live, "a question from a hostile client", hostile)
    page.goto(live.url + "/dashboard")
    title = page.title()
    cell = page.locator("#sessions td.id", has_text="onerror")
    cell.wait_for(timeout=WAIT_MS)
    assert cell.inner_text() == hostile
    assert page.locator("#sessions img").count() == 0 and page.title() == title
    row = page.locator("#sessions tbody tr", has=page.locator("td.id", has_text="onerror"))
    row.locator('button[data-action="delete"]').click()
    row.locator('button[data-action="delete"]').click()  # confirm
    row.wait_for(state="detached", timeout=WAIT_MS)
    assert hostile not in {s["id"] for s in api(live, "/v1/cache/sessions")["sessions"]}
    assert page.problems == []


@needs_browser
def test_alert_banner_shows_when_the_hit_ratio_of_the_last_20_drops(live, page):
    page.goto(live.url + "/dashboard")
    repeated = "The same long question, asked again and again. " * 8
    for _ in range(21):  # fills the alert's window with hits
        chat(live, repeated, "dash-steady")
    assert api(live, "/v1/cache/stats")["alert"] is None
    next_poll(page)
    assert page.locator("#alert").is_hidden()
    for i in range(20):  # a new conversation each time: nothing to hit
        chat(live, f"Question number {i} starts a brand new topic. " * 4, f"dash-new-{i}")
    alert = api(live, "/v1/cache/stats")["alert"]
    assert alert is not None and alert["hit_ratio"] < alert["threshold"]
    # The banner may have come up mid-way (at a higher ratio); it shows the final one.
    banner = f"⚠ {alert['message']}"
    until(
        lambda: page.locator("#alert").is_visible() and text(page, "#alert") == banner, banner, page
    )
    assert page.problems == []


def percent(r: float) -> str:
    """A share as the page writes it: JavaScript's toFixed rounds a tie up."""
    digits = Decimal("0.1") if 0 < r < 0.1 else Decimal(1)
    return f"{Decimal(r * 100).quantize(digits, ROUND_HALF_UP)}%"


@needs_browser
def test_lost_tokens_card_ranks_the_causes_with_their_fixes(live, page):
    """A client that stamps the time into its system prompt, three turns: the card ranks
    every cause the server's diagnosis gives, with its tokens, share and fix, and the
    normalization rule that keeps the prefix as TOML to paste."""
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=60)
    history = [{"role": "user", "content": "Which report needs the region and the month?"}]
    for turn in range(3):
        system = (f"You are the ledger assistant.\nCurrent time: 2026-12-05 0{turn}:1{turn}:"
                  f"{turn}7\n" + "Answer in one short sentence. " * 30)  # fmt: skip
        reply = client.chat.completions.create(
            model="demo-llama",
            messages=[{"role": "system", "content": system}, *history],
            max_tokens=1,
            temperature=0,
            extra_headers={"x-session-id": "dash-stamped"},
        )
        history += [{"role": "assistant", "content": reply.choices[0].message.content or "."},
                    {"role": "user", "content": f"And the currency? ({turn})"}]  # fmt: skip
    body = api(live, "/v1/cache/diagnosis")
    causes = {c["cause"]: c for c in body["causes"]}
    rewrote = causes["client_rewrote"]
    assert rewrote["fix"]["key"] == "normalization.rules"
    assert rewrote["requests"] >= 2 and rewrote["tokens"] > 0

    page.goto(live.url + "/dashboard")
    ranked = lambda: page.eval_on_selector_all(  # noqa: E731
        "#lost-causes li", "els => els.map(e => e.dataset.cause)"
    )
    until(lambda: ranked() == list(causes), f"the causes {list(causes)}", page)
    fresh = causes.get("new_content", {}).get("tokens", 0)
    assert text(page, "#lost") == f"{body['computed_tokens'] - fresh:,}"
    assert page.text_content("#lost-window") == "(last hour)"  # the label is set in capitals
    assert text(page, "#lost-detail") == (
        f"of {body['computed_tokens']:,} prompt tokens computed ({fresh:,} new) in "
        f"{body['requests']:,} requests; {percent(body['hit_ratio'])} came from the cache"
    )
    for name, c in causes.items():
        row = page.locator(f'#lost-causes li[data-cause="{name}"]')
        assert row.locator(".tokens").inner_text() == f"{c['tokens']:,} tokens", name
        assert row.locator(".share").inner_text() == percent(c["share"]), name
        assert float(row.locator("meter").get_attribute("value")) == c["share"], name
        assert row.locator(".fix").text_content() == c["fix"]["text"], name
        setting = row.locator("code.setting")
        if c["fix"]["key"] is None:
            assert setting.count() == 0, name
        else:
            assert setting.text_content() == f"{c['fix']['key']} = {inline(c['fix']['value'])}"
    row = page.locator('#lost-causes li[data-cause="client_rewrote"]')
    assert row.locator(".name").inner_text() == "client rewrote earlier messages"
    assert "Current time:" in row.locator("code.setting").text_content()
    assert page.problems == []


@needs_browser
def test_autotune_card_says_off_on_a_server_with_fixed_settings(live, page):
    assert api(live, "/v1/cache/stats")["autotune"] == {"enabled": False}
    page.goto(live.url + "/dashboard")
    polled(page, 1)
    assert (text(page, "#autotune"), text(page, "#autotune-detail")) == (
        "off",
        "fixed settings ([autotune] enabled = false)",
    )
    assert page.locator("#autotune-settings").is_hidden()
    assert page.locator("#autotune-changes li").count() == 0


@needs_browser
def test_page_asks_for_the_key_and_shows_only_that_tenants_sessions(demo_root, tmp_path, page):
    server = start_server(
        fresh_cache_dir(demo_root, tmp_path / "keyed"),
        *("--host", "0.0.0.0", "--upstream", "http://127.0.0.1:9"),
        env={"MLX_PROMPT_CACHE_TENANTS_API_KEYS": f"{KEY}=team,sk-other=other"},
    )
    try:
        for key, session in ((KEY, "team-session"), ("sk-other", "other-session")):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            client.chat.completions.create(
                model="demo-llama",
                messages=[{"role": "user", "content": "the same question from two tenants"}],
                max_tokens=1,
                extra_headers={"x-session-id": session},
            )
        page.goto(server.url + "/dashboard")
        page.locator("#keyform").wait_for(state="visible", timeout=WAIT_MS)
        assert text(page, "#keynote").startswith("This server wants an API key")
        assert text(page, "#requests") == "–"
        page.fill("#key", KEY)
        page.click("#keyform button[type=submit]")
        team_row = page.locator('#sessions tr[data-id="team-session"]')
        team_row.wait_for(timeout=WAIT_MS)
        assert text(page, "#keynote") == "Using the API key kept for this tab."
        assert page.locator("#sessions tbody tr").count() == 1  # not the other tenant's
        assert text(page, "#sessions-count") == "(1)"
        page.reload()  # sessionStorage keeps it for the tab, not beyond
        team_row.wait_for(timeout=WAIT_MS)
        page.click("#forget")
        until(lambda: text(page, "#keynote").startswith("This server wants"), "refusal", page)
        assert page.problems == []
    finally:
        server.stop()
