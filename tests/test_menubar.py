"""The SwiftBar/xbar plugin against a live stats server and against a closed port."""

from __future__ import annotations

import asyncio
import os
import shlex
import socket
from pathlib import Path

import pytest
from aiohttp import web

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "mlx-prompt-cache.30s.sh"
KNOWN_PARAMS = {"bash", "terminal", "refresh", "href", "color"} | {
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


@pytest.fixture
def sandbox(tmp_path: Path) -> dict[str, str]:
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


async def run_plugin(url: str, sandbox: dict[str, str], *args: str) -> str:
    env = {k: v for k, v in sandbox.items() if k != "TMP"}
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


async def stats_server(aiohttp_server, stats: dict | None, status: int = 200):
    async def cache_stats(request: web.Request) -> web.Response:
        return web.json_response(stats, status=status)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "models": ["demo-llama", "demo-hybrid"]})

    app = web.Application()
    app.router.add_get("/v1/cache/stats", cache_stats)
    app.router.add_get("/health", health)
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
        ("Open dashboard", {"href": f"{url}/v1/cache/stats"}),
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
