"""The SwiftBar/xbar plugin against a live stats server, the real proxy and a closed port."""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
from pathlib import Path

import httpx
import pytest
from aiohttp import web

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mlx-prompt-cache.30s.sh"
KNOWN_PARAMS = {"bash", "terminal", "refresh", "href", "color", "length"} | {
    f"param{i}" for i in range(1, 10)
}
UID = os.getuid()
SERVICE = f"gui/{UID}/com.mlx-prompt-cache"


def parse_line(line: str) -> tuple[str, dict[str, str]]:
    """A SwiftBar line as (text, params); asserts the syntax and that every key is known."""
    if " | " not in line:
        assert "|" not in line, line
        return line, {}
    text, _, rest = line.partition(" | ")
    params = {}
    for token in shlex.split(rest):
        key, sep, value = token.partition("=")
        assert sep and key in KNOWN_PARAMS, f"unknown parameter {token!r} in {line!r}"
        params[key] = value
    return text, params


def parse_output(out: str) -> list[tuple[str, dict[str, str]]]:
    lines = out.splitlines()
    assert lines[1] == "---", lines  # title, then the dropdown
    return [parse_line(line) for line in lines]


@pytest.fixture(name="sandbox")
def sandbox_fixture(tmp_path: Path) -> dict[str, str]:
    """HOME, a fake launchctl that records its arguments, and a fake CLI on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launchctl = bin_dir / "launchctl"
    launchctl.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{tmp_path}/launchctl.log"\n'
        # `print` answers whether the agent is loaded, per the test's marker file.
        f'if [ "$1" = print ]; then [ -e "{tmp_path}/loaded" ]; exit $?; fi\n'
    )
    launchctl.chmod(0o755)
    cli = bin_dir / "mlx-prompt-cache"
    cli.write_text("#!/usr/bin/env bash\nexit 0\n")
    cli.chmod(0o755)
    return {
        "HOME": str(tmp_path),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "LAUNCHCTL": str(launchctl),
        "TMP": str(tmp_path),
    }


async def run_plugin(url: str, sandbox: dict[str, str], *args: str, **extra_env: str) -> str:
    env = {k: v for k, v in sandbox.items() if k != "TMP"} | extra_env
    env["MLX_PROMPT_CACHE_URL"] = url
    proc = await asyncio.create_subprocess_exec(
        "bash",
        str(SCRIPT),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert err == b"", err.decode()
    return out.decode()


async def stats_server(
    aiohttp_server,
    stats: dict | None,
    status: int = 200,
    sessions: list[dict] | None = None,
    key: str | None = None,
    diagnosis: dict | None = None,
):
    """Stats and health; GET /v1/cache/sessions and /v1/cache/diagnosis only when
    `sessions` or `diagnosis` is given; with `key`, the cache routes answer 401 to a
    request without 'Authorization: Bearer <key>'."""

    def keyed(handler):
        async def check(request: web.Request) -> web.Response:
            if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
                return web.json_response({"error": {"message": "no key"}}, status=401)
            return await handler(request)

        return check

    async def cache_stats(request: web.Request) -> web.Response:
        return web.json_response(stats, status=status)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "models": ["demo-llama", "demo-hybrid"]})

    async def list_sessions(request: web.Request) -> web.Response:
        return web.json_response({"sessions": sessions})

    async def diagnose(request: web.Request) -> web.Response:
        assert request.query["window"] == "1h"
        return web.json_response(diagnosis)

    app = web.Application()
    app.router.add_get("/v1/cache/stats", keyed(cache_stats))
    app.router.add_get("/health", health)
    if sessions is not None:
        app.router.add_get("/v1/cache/sessions", keyed(list_sessions))
    if diagnosis is not None:
        app.router.add_get("/v1/cache/diagnosis", keyed(diagnose))
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


async def test_up_shows_hit_ratio_details_and_actions(aiohttp_server, sandbox):
    stats = {
        "requests": 12,
        "hits": 9,
        "misses": 3,
        "hit_ratio": 0.8712,
        "ram": {"bytes": 123_456_789, "blocks": 42},
        "ssd": {"bytes": 5_000_000_000, "blocks": 1700, "spills": 4, "reloads": 2},
    }
    url = await stats_server(aiohttp_server, stats)
    out = await run_plugin(url, sandbox)
    cli = Path(sandbox["PATH"].split(":")[0]) / "mlx-prompt-cache"
    launchctl = sandbox["LAUNCHCTL"]
    assert parse_output(out) == [
        ("⚡ 87%", {}),
        ("---", {}),
        (f"mlx-prompt-cache at {url}", {"href": f"{url}/health"}),
        ("Token hit ratio: 87%", {}),
        ("Requests: 12 (9 hits, 3 misses)", {}),
        ("RAM: 123.5 MB in 42 blocks", {}),
        ("SSD: 5.0 GB in 1700 blocks", {}),
        ("SSD spills/reloads: 4/2", {}),
        ("Models: demo-llama, demo-hybrid", {}),
        ("---", {}),
        ("Open dashboard", {"href": f"{url}/dashboard"}),
        (
            "Restart",
            {
                "bash": launchctl,
                "param1": "kickstart",
                "param2": "-k",
                "param3": SERVICE,
                "terminal": "false",
                "refresh": "true",
            },
        ),
        (
            "Stop",
            {
                "bash": launchctl,
                "param1": "bootout",
                "param2": SERVICE,
                "terminal": "false",
                "refresh": "true",
            },
        ),
        (
            "Clear cache",
            {
                "bash": str(cli),
                "param1": "cache",
                "param2": "clear",
                "terminal": "false",
                "refresh": "true",
            },
        ),
        (
            "Open logs",
            {
                "bash": "/usr/bin/open",
                "param1": f"{sandbox['HOME']}/Library/Logs/mlx-prompt-cache",
                "terminal": "false",
            },
        ),
        ("Refresh", {"refresh": "true"}),
    ]


async def test_nested_request_stats_shape_is_read_too(aiohttp_server, sandbox):
    stats = {
        "requests": {"total": 4, "hits": 1, "misses": 3, "hit_ratio": 0.25},
        "hit_ratio": 0.25,
        "models": ["demo-swa"],
    }
    url = await stats_server(aiohttp_server, stats)
    lines = parse_output(await run_plugin(url, sandbox))
    texts = [text for text, _ in lines]
    assert texts[0] == "⚡ 25%"
    assert "Requests: 4 (1 hits, 3 misses)" in texts
    assert "Models: demo-swa" in texts  # from the stats, before /health's list
    assert not any(t.startswith(("RAM:", "SSD")) for t in texts)


async def test_missing_fields_are_tolerated(aiohttp_server, sandbox):
    url = await stats_server(aiohttp_server, {})
    lines = parse_output(await run_plugin(url, sandbox))
    texts = [text for text, _ in lines]
    assert texts[0] == "⚡ up"
    assert texts[2:5] == [f"mlx-prompt-cache at {url}", "Models: demo-llama, demo-hybrid", "---"]
    assert "Restart" in texts and "Stop" in texts


async def test_stats_error_status_shows_error(aiohttp_server, sandbox):
    url = await stats_server(aiohttp_server, {"error": "boom"}, status=500)
    lines = parse_output(await run_plugin(url, sandbox))
    assert lines[0] == ("⚡ error", {})
    assert lines[2] == (f"{url}/v1/cache/stats answered HTTP 500", {"color": "red"})


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_down_shows_stopped_and_bootstrap_start(sandbox):
    url = closed_port_url()
    lines = parse_output(await run_plugin(url, sandbox))
    plist = f"{sandbox['HOME']}/Library/LaunchAgents/com.mlx-prompt-cache.plist"
    assert lines[:5] == [
        ("⚡ stopped", {}),
        ("---", {}),
        ("mlx-prompt-cache is not running", {}),
        (f"nothing listening at {url}", {"color": "gray"}),
        ("---", {}),
    ]
    text, start = lines[5]
    assert text == "Start"
    assert start == {
        "bash": sandbox["LAUNCHCTL"],
        "param1": "bootstrap",
        "param2": f"gui/{UID}",
        "param3": plist,
        "terminal": "false",
        "refresh": "true",
    }
    assert [t for t, _ in lines[6:]] == ["Open logs", "Refresh"]


async def test_down_but_loaded_starts_with_kickstart(sandbox):
    (Path(sandbox["TMP"]) / "loaded").touch()
    lines = parse_output(await run_plugin(closed_port_url(), sandbox))
    start = dict(lines)["Start"]
    assert (start["param1"], start["param2"]) == ("kickstart", SERVICE)


async def test_actions_run_launchctl_with_the_listed_params(aiohttp_server, sandbox):
    url = await stats_server(aiohttp_server, {"hit_ratio": 0.5})
    actions = dict(parse_output(await run_plugin(url, sandbox)))
    for name in ("Restart", "Stop"):
        params = actions[name]
        argv = [params["bash"]] + [
            params[f"param{i}"] for i in range(1, 10) if f"param{i}" in params
        ]
        proc = await asyncio.create_subprocess_exec(*argv)
        assert await proc.wait() == 0
    log = (Path(sandbox["TMP"]) / "launchctl.log").read_text().splitlines()
    assert log[-2:] == [f"kickstart -k {SERVICE}", f"bootout {SERVICE}"]


# ---------------------------------------------------------------------------------------
# Sessions, the hit-ratio alert and the dashboard link


def session(i: int, **fields) -> dict:
    return {
        "id": f"s{i}",
        "tenant": "local",
        "model": "demo-llama",
        "last_used": 1_790_000_000.0 - i,
        "tokens": 1000 * (i + 1),
        "ram_bytes": 10,
        "ssd_bytes": 20,
        "shared_bytes": 30,
        "pinned": False,
    } | fields


async def test_sessions_count_newest_five_and_the_alert(aiohttp_server, sandbox):
    sessions = [
        session(0, id="claude|code ①", model="demo-hybrid"),
        session(1, id="x" * 80),
        *(session(i) for i in range(2, 7)),
    ]
    alert = {
        "message": "cache hit ratio 12% over the last 20 requests is below 50%",
        "hit_ratio": 0.12,
        "threshold": 0.5,
        "window": 20,
    }
    stats = {"hit_ratio": 0.31, "alert": alert}
    url = await stats_server(aiohttp_server, stats, sessions=sessions)
    lines = parse_output(await run_plugin(url, sandbox))
    assert lines[0] == ("⚡ 31% ⚠", {})
    assert lines[3] == (f"⚠ {alert['message']}", {"color": "red", "href": f"{url}/dashboard"})
    texts = [text for text, _ in lines]
    start = texts.index("Sessions: 7")
    assert texts[start + 1 : start + 7] == [
        "--claude¦code ①: 1000 tokens (demo-hybrid)",
        f"--{'x' * 47}…: 2000 tokens (demo-llama)",
        "--s2: 3000 tokens (demo-llama)",
        "--s3: 4000 tokens (demo-llama)",
        "--s4: 5000 tokens (demo-llama)",
        "---",
    ]
    assert dict(lines)["Open dashboard"] == {"href": f"{url}/dashboard"}


async def test_no_alert_and_no_sessions_route_show_neither(aiohttp_server, sandbox):
    url = await stats_server(aiohttp_server, {"hit_ratio": 0.9, "alert": None})
    lines = parse_output(await run_plugin(url, sandbox))
    assert lines[0] == ("⚡ 90%", {})
    assert not any(t.startswith(("⚠", "Sessions", "--")) and t != "---" for t, _ in lines)


async def test_a_long_session_list_is_counted_whole_and_read_only_where_complete(
    aiohttp_server, sandbox
):
    # 4,000 bytes of the list hold about 14 sessions; the count still covers all 300.
    sessions = [session(i, id=f"session-{i:04d}") for i in range(300)]
    url = await stats_server(aiohttp_server, {"hit_ratio": 0.5}, sessions=sessions)
    texts = [t for t, _ in parse_output(await run_plugin(url, sandbox))]
    start = texts.index("Sessions: 300")
    shown = texts[start + 1 : start + 6]
    assert shown == [f"--session-{i:04d}: {1000 * (i + 1)} tokens (demo-llama)" for i in range(5)]


async def test_api_key_from_the_environment_is_sent(aiohttp_server, sandbox):
    url = await stats_server(aiohttp_server, {"hit_ratio": 0.5}, sessions=[session(0)], key="k1")
    texts = [t for t, _ in parse_output(await run_plugin(url, sandbox))]
    assert texts[0] == "⚡ error"  # 401 without the key
    lines = parse_output(await run_plugin(url, sandbox, MLX_PROMPT_CACHE_API_KEY="k1"))
    assert lines[0] == ("⚡ 50%", {})
    assert "Sessions: 1" in [t for t, _ in lines]


async def test_real_proxy_sessions_match_its_sessions_route(server, sandbox):
    """The plugin against the real proxy: its session count and newest session are the API's."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    await client.chat.completions.create(
        model="demo-llama",
        messages=[{"role": "user", "content": "menu bar plugin test: " + "tokens " * 30}],
        max_tokens=2,
        extra_headers={"x-session-id": "menubar-newest"},
    )
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        r = await http.get("/v1/cache/sessions")
    assert r.status_code == 200, r.text
    listed = r.json()["sessions"]
    lines = parse_output(await run_plugin(server.url, sandbox))
    texts = [t for t, _ in lines]
    start = texts.index(f"Sessions: {len(listed)}")
    newest = listed[0]
    assert newest["id"] == "menubar-newest"
    assert texts[start + 1] == f"--menubar-newest: {newest['tokens']} tokens (demo-llama)"
    assert dict(lines)["Open dashboard"] == {"href": f"{server.url}/dashboard"}


# ---------------------------------------------------------------------------------------
# Lost tokens: the costliest cause besides new content, and its fix


def cause(name: str, tokens: int, share: float, text: str, key=None, value=None) -> dict:
    return {"cause": name, "tokens": tokens, "share": share, "requests": 2,
            "actionable": name != "new_content",
            "fix": {"text": text, "key": key, "value": value}}  # fmt: skip


def diagnosis(*causes: dict) -> dict:
    computed = sum(c["tokens"] for c in causes)
    group = {"name": "demo-llama", "requests": 4, "prompt_tokens": 2000,
             "computed_tokens": computed, "hit_ratio": 0.25, "top_cause": None,
             "top_cause_tokens": 0}  # fmt: skip
    return {"window_s": 3600.0, "filter": {"model": None, "tenant": None, "session": None},
            "requests": 4, "prompt_tokens": 2000, "cached_tokens": 2000 - computed,
            "computed_tokens": computed, "hit_ratio": 0.25, "causes": list(causes),
            "by_model": [group], "by_tenant": [group | {"name": "local"}],
            "by_session": [group | {"name": "s1"}]}  # fmt: skip


async def test_lost_line_names_the_top_cause_besides_new_content_and_its_fix(
    aiohttp_server, sandbox
):
    rule = {"name": "volatile-time", "pattern": "Current\\ time:\\ \\d+",
            "replacement": "Current time: <time>", "roles": ["system", "user"]}  # fmt: skip
    rewrote = ("the client rewrites message 0 changed at 'time: 2026-12-05 0' | '2:12:27\\n"
               "The billing ' (was '1:11:17\\n\"by_model\": ①'), costing 705 tokens: this rule "
               "makes the changing text the same every time")  # fmt: skip
    body = diagnosis(
        cause("new_content", 900, 0.5233, "nothing to change: no earlier request sent these"),
        cause("client_rewrote", 705, 0.4099, rewrote, "normalization.rules", rule),
        cause("bypass", 115, 0.0669, "1 requests asked for no cache (x-prompt-cache: bypass)"),
    )
    url = await stats_server(aiohttp_server, {"hit_ratio": 0.25, "requests": 4},
                             diagnosis=body)  # fmt: skip
    lines = parse_output(await run_plugin(url, sandbox))
    texts = [t for t, _ in lines]
    lost = texts.index("Requests: 4") + 1  # under the request counts
    assert lines[lost] == (
        "Lost: client_rewrote, 705 tokens (41%): " + rewrote.replace("|", "¦"),
        {"length": "72", "href": f"{url}/dashboard"},
    )
    assert sum(t.startswith("Lost:") for t in texts) == 1


async def test_no_lost_line_with_only_new_content_nothing_in_the_window_or_no_route(
    aiohttp_server, sandbox
):
    only_new = diagnosis(cause("new_content", 900, 1.0, "nothing to change"))
    empty = diagnosis() | {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0,
                           "hit_ratio": None, "by_model": [], "by_tenant": [],
                           "by_session": []}  # fmt: skip
    for body in (only_new, empty, None):
        url = await stats_server(aiohttp_server, {"hit_ratio": 0.5}, diagnosis=body)
        texts = [t for t, _ in parse_output(await run_plugin(url, sandbox))]
        assert texts[0] == "⚡ 50%"
        assert not any(t.startswith("Lost") for t in texts), texts


async def test_lost_line_needs_the_key_like_the_other_cache_routes(aiohttp_server, sandbox):
    body = diagnosis(cause("expired", 300, 1.0, "300 tokens expired: a TTL of 3h keeps them",
                           "cache.session_ttl", "3h"))  # fmt: skip
    url = await stats_server(aiohttp_server, {"hit_ratio": 0.5}, key="k1", diagnosis=body)
    lines = parse_output(await run_plugin(url, sandbox, MLX_PROMPT_CACHE_API_KEY="k1"))
    assert ("Lost: expired, 300 tokens (100%): 300 tokens expired: a TTL of 3h keeps them",
            {"length": "72", "href": f"{url}/dashboard"}) in lines  # fmt: skip


async def test_real_proxy_lost_line_is_its_diagnosis_top_cause(server, sandbox):
    """The plugin against the real proxy: a bypassed request is a cause besides new
    content, and the line names the top one the diagnosis ranks, with its fix."""
    import openai

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    await client.chat.completions.create(
        model="demo-llama",
        messages=[{"role": "user", "content": "menu bar lost tokens: " + "tokens " * 60}],
        max_tokens=1,
        extra_headers={"x-session-id": "menubar-bypass", "x-prompt-cache": "bypass"},
    )
    lines = parse_output(await run_plugin(server.url, sandbox))
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        r = await http.get("/v1/cache/diagnosis", params={"window": "1h"})
    assert r.status_code == 200, r.text
    top = next(c for c in r.json()["causes"] if c["cause"] != "new_content")
    fix = top["fix"]["text"].replace("|", "¦")
    for control in "\n\t\r":  # the plugin's JSON reader writes them as spaces
        fix = fix.replace(control, " ")
    expected = f"Lost: {top['cause']}, {top['tokens']} tokens ({top['share'] * 100:.0f}%): {fix}"
    assert (expected, {"length": "72", "href": f"{server.url}/dashboard"}) in lines
