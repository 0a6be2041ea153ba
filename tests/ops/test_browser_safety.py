"""Closed to the browser next door: Host, Origin, content type, CORS and exposure, in raw HTTP.

Clients (httpx, aiohttp, the SDKs) set Host and Content-Type themselves, so every request
here is written byte for byte on a socket (tests/support/raw_http.py). The app runs in-process on a
real engine with demo-llama; the exposure checks start the real `serve` command.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys

import httpx
import psutil
import pytest

from engine_bridge.engine import Engine, EngineSettings
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.security import BrowserPolicy, browser_policy, split_host
from proxy.state import ProxySettings
from tests.conftest import REPO, free_port, fresh_cache_dir, start_server
from tests.support.raw_http import Local, Reply, raw_request

MODEL = "demo-llama"
USER = [{"role": "user", "content": "hi"}]
# Every POST route served here that reads a JSON body, with a body it accepts.
JSON_ROUTES = {
    "/v1/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 1},
    "/v1/completions": {"model": MODEL, "prompt": "The cache", "max_tokens": 1},
    "/api/v0/chat/completions": {"model": MODEL, "messages": USER, "max_tokens": 1},
    "/api/v0/completions": {"model": MODEL, "prompt": "The cache", "max_tokens": 1},
    "/v1/messages": {"model": MODEL, "messages": USER, "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": USER},
}


def error_message(reply: Reply, dialect: str) -> str:
    """The message of an error body, after checking it has the dialect's shape."""
    body = reply.json()
    if dialect == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    return body["error"]["message"]


def dialect(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def access_control(reply: Reply) -> dict[str, str]:
    return {k: v for k, v in reply.headers.items() if k.startswith("access-control-")}


@pytest.fixture
def engine(demo_root, tmp_path) -> Engine:
    return Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=[MODEL],
            ssd_enabled=False,
        )
    )


@pytest.fixture
def serve_app(aiohttp_server, engine):
    """Start the app with a policy; returns a raw-HTTP client bound to its port."""

    async def start(policy: BrowserPolicy | None = None) -> Local:
        app = create_app(engine, ProxySettings(), UpstreamConfig(enabled=False), policy)
        server = await aiohttp_server(app)
        return Local(server.port)

    return start


# ---------------------------------------------------------------------------------------
# Host allowlist


async def test_foreign_host_is_403_in_each_dialect_before_routing(serve_app):
    local = await serve_app()
    r = await local.get(
        "/v1/models", ("Origin", "http://attacker.example"), host="attacker.example"
    )
    assert r.status == 403
    message = error_message(r, "openai")
    assert "'attacker.example'" in message and "allowed_hosts" in message
    assert r.json()["error"]["code"] == "host_not_allowed"
    r = await local.post("/v1/messages", JSON_ROUTES["/v1/messages"], host="attacker.example:1235")
    assert r.status == 403
    assert "attacker.example" in error_message(r, "anthropic")
    assert r.json()["error"]["type"] == "permission_error"
    # A passthrough path is refused before routing (otherwise: 404, the upstream is off).
    r = await local.get("/api/v1/models", host="rebind.attacker.example")
    assert r.status == 403


async def test_missing_or_doubled_host_is_403(serve_app):
    local = await serve_app()
    r = await raw_request(local.port, "GET", "/health", [], version="HTTP/1.0")
    assert r.status == 403
    assert "0 Host headers" in error_message(r, "openai")
    r = await raw_request(
        local.port, "GET", "/health", [("Host", "127.0.0.1"), ("Host", "attacker.example")]
    )
    assert r.status in (400, 403)  # aiohttp's parser may refuse a doubled Host itself


@pytest.mark.parametrize(
    "host", ["localhost", "LOCALHOST:1235", "localhost.:9", "127.0.0.1", "127.0.0.1:80", "[::1]:1"]
)
async def test_loopback_hosts_are_answered_on_any_port(serve_app, host):
    local = await serve_app()
    r = await local.get("/health", host=host)
    assert r.status == 200, r.body
    assert r.json()["status"] == "ok"


async def test_configured_allowed_hosts_are_answered_with_their_port_rules(serve_app):
    policy = browser_policy("127.0.0.1", allowed_hosts=["MyMac.local", "box.lan:8080", "10.0.0.7"])
    local = await serve_app(policy)
    for host, status in [
        ("mymac.local:1235", 200),
        ("mymac.local", 200),
        ("box.lan:8080", 200),
        ("box.lan:9090", 403),
        ("box.lan", 403),
        ("10.0.0.7:1235", 200),
        ("10.0.0.8:1235", 403),
        ("attacker.example", 403),
    ]:
        r = await local.get("/v1/models", host=host)
        assert r.status == status, (host, r.body)


def test_bind_address_is_allowed_and_wildcard_allows_this_machines_addresses():
    assert browser_policy("192.168.1.20").host_allowed(*split_host("192.168.1.20:1235"))
    assert browser_policy("mymac.local").host_allowed("mymac.local", 1235)
    assert not browser_policy("127.0.0.1").host_allowed("mymac.local", 1235)
    wildcard = browser_policy("0.0.0.0")
    addresses = [
        a.address.split("%")[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    ]
    assert addresses
    assert all(wildcard.host_allowed(split_host(a)[0], 1235) for a in addresses)
    assert not wildcard.host_allowed("attacker.example", 1235)


# ---------------------------------------------------------------------------------------
# Origin on state-changing requests


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_cross_origin_post_is_403_naming_the_origin(serve_app, path):
    local = await serve_app()
    r = await local.post(path, JSON_ROUTES[path], ("Origin", "http://attacker.example"))
    assert r.status == 403
    message = error_message(r, dialect(path))
    assert "'http://attacker.example'" in message and "cors_origins" in message
    assert access_control(r) == {}


async def test_cross_origin_delete_and_websocket_to_passthrough_are_403(serve_app):
    local = await serve_app()
    r = await raw_request(
        local.port,
        "DELETE",
        "/api/v1/models/x",
        [("Host", local.host), ("Origin", "https://attacker.example")],
    )
    assert r.status == 403
    # Browsers apply no CORS to WebSockets; the upgrade is checked like a POST.
    r = await local.get(
        "/api/v1/ws",
        ("Origin", "http://attacker.example"),
        ("Upgrade", "websocket"),
        ("Connection", "Upgrade"),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("Sec-WebSocket-Version", "13"),
    )
    assert r.status == 403


async def test_same_origin_loopback_and_originless_posts_pass(serve_app):
    local = await serve_app()
    body = JSON_ROUTES["/v1/messages/count_tokens"]
    for origin in [
        f"http://127.0.0.1:{local.port}",
        f"http://localhost:{local.port}",
        f"http://[::1]:{local.port}",
        None,
    ]:
        extra = [("Origin", origin)] if origin else []
        r = await local.post("/v1/messages/count_tokens", body, *extra)
        assert r.status == 200, (origin, r.body)
        assert r.json()["input_tokens"] > 0
    # Loopback, but another port: another local web app, not a page of ours.
    r = await local.post(
        "/v1/messages/count_tokens", body, ("Origin", f"http://localhost:{local.port + 1}")
    )
    assert r.status == 403
    # "null" (sandboxed frames, file:// pages) is no origin of ours either.
    r = await local.post("/v1/messages/count_tokens", body, ("Origin", "null"))
    assert r.status == 403


async def test_cross_origin_get_is_answered_without_cors_headers(serve_app):
    local = await serve_app()
    r = await local.get("/v1/models", ("Origin", "http://attacker.example"))
    assert r.status == 200
    assert access_control(r) == {}  # the browser keeps the body from the page


# ---------------------------------------------------------------------------------------
# JSON content type


@pytest.mark.parametrize("path", list(JSON_ROUTES))
@pytest.mark.parametrize(
    "content_type,named",
    [
        ("text/plain", "'text/plain'"),
        ("text/plain;charset=UTF-8", "'text/plain;charset=UTF-8'"),
        ("application/x-www-form-urlencoded", "'application/x-www-form-urlencoded'"),
        ("multipart/form-data; boundary=x", "'multipart/form-data; boundary=x'"),
        (None, "no Content-Type"),
    ],
)
async def test_json_route_refuses_other_content_types_with_415(
    serve_app, path, content_type, named
):
    local = await serve_app()
    r = await local.post(path, JSON_ROUTES[path], content_type=content_type)
    assert r.status == 415, r.body
    message = error_message(r, dialect(path))
    assert named in message and "application/json" in message
    if dialect(path) == "openai":
        assert r.json()["error"]["param"] == "Content-Type"
        assert r.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
async def test_json_content_types_are_accepted(serve_app, content_type):
    local = await serve_app()
    r = await local.post(
        "/v1/messages/count_tokens",
        JSON_ROUTES["/v1/messages/count_tokens"],
        content_type=content_type,
    )
    assert r.status == 200, r.body


async def test_passthrough_body_type_is_left_to_the_upstream(serve_app):
    local = await serve_app()
    r = await local.post("/v1/embeddings", b"input=x", content_type="text/plain")
    assert r.status == 404  # the passthrough's answer (upstream off), not a 415
    assert "upstream" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------------------
# CORS


def preflight(origin: str) -> list[tuple[str, str]]:
    return [
        ("Origin", origin),
        ("Access-Control-Request-Method", "POST"),
        ("Access-Control-Request-Headers", "content-type, authorization"),
    ]


async def test_cors_off_preflight_gets_no_allow(serve_app):
    local = await serve_app()
    for origin in ["http://attacker.example", "http://localhost:3000"]:
        r = await raw_request(
            local.port,
            "OPTIONS",
            "/v1/chat/completions",
            [("Host", local.host)] + preflight(origin),
        )
        assert r.status == 403
        assert access_control(r) == {}
        assert "cors_origins" in error_message(r, "openai")


async def test_cors_on_answers_listed_origin_only(serve_app):
    listed = "http://localhost:3000"
    local = await serve_app(browser_policy("127.0.0.1", cors_origins=[listed]))
    r = await raw_request(
        local.port, "OPTIONS", "/v1/messages", [("Host", local.host)] + preflight(listed)
    )
    assert r.status == 204
    assert r.headers["access-control-allow-origin"] == listed
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "content-type, authorization"
    assert "Origin" in r.headers["vary"]
    r = await local.post(
        "/v1/messages/count_tokens", JSON_ROUTES["/v1/messages/count_tokens"], ("Origin", listed)
    )
    assert r.status == 200
    assert r.headers["access-control-allow-origin"] == listed
    assert "x-prompt-cache-source" in r.headers["access-control-expose-headers"]
    assert "Origin" in r.headers["vary"]
    # An origin not on the list: no preflight, no POST, no readable GET.
    other = "http://attacker.example"
    r = await raw_request(
        local.port, "OPTIONS", "/v1/messages", [("Host", local.host)] + preflight(other)
    )
    assert r.status == 403 and "access-control-allow-origin" not in r.headers
    r = await local.post(
        "/v1/messages/count_tokens", JSON_ROUTES["/v1/messages/count_tokens"], ("Origin", other)
    )
    assert r.status == 403 and "access-control-allow-origin" not in r.headers
    r = await local.get("/v1/models", ("Origin", other))
    assert r.status == 200 and "access-control-allow-origin" not in r.headers
    assert "Origin" in r.headers["vary"]


async def test_cors_star_must_be_explicit_and_echoes_the_origin(serve_app):
    local = await serve_app(browser_policy("127.0.0.1", cors_origins=["*"]))
    r = await local.get("/v1/models", ("Origin", "http://anything.example"))
    assert r.headers["access-control-allow-origin"] == "http://anything.example"
    assert "access-control-allow-credentials" not in r.headers


# ---------------------------------------------------------------------------------------
# API keys when the server is reachable from the network


async def test_exposed_server_with_keys_wants_a_key_on_every_route_but_health(serve_app):
    local = await serve_app(browser_policy("0.0.0.0", api_keys=["sk-team"]))
    body = JSON_ROUTES["/v1/messages/count_tokens"]
    r = await local.post("/v1/messages/count_tokens", body)
    assert r.status == 401
    assert "api_keys" in error_message(r, "anthropic")
    assert r.json()["error"]["type"] == "authentication_error"
    r = await local.get("/v1/models", ("Authorization", "Bearer sk-wrong"))
    assert r.status == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = await local.post("/v1/messages/count_tokens", body, ("x-api-key", "sk-team"))
    assert r.status == 200
    r = await local.get("/v1/models", ("Authorization", "Bearer sk-team"))
    assert r.status == 200
    assert (await local.get("/health")).status == 200


async def test_a_key_header_that_is_not_utf8_is_a_wrong_key_not_a_500(serve_app):
    # aiohttp decodes such bytes as lone surrogates, which str.encode() refused.
    local = await serve_app(browser_policy("0.0.0.0", api_keys=["sk-team"]))
    async with httpx.AsyncClient(base_url=f"http://{local.host}") as client:
        for name, value in (("authorization", b"Bearer sk-\xff"), ("x-api-key", b"sk-\xff")):
            r = await client.get("/v1/models", headers={name: value})
            assert r.status_code == 401, (name, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"


async def test_loopback_server_with_keys_needs_no_key(serve_app):
    local = await serve_app(browser_policy("127.0.0.1", api_keys=["sk-team"]))
    assert (await local.get("/v1/models")).status == 200


# ---------------------------------------------------------------------------------------
# serve: refusing to open the network without keys


def test_serve_on_all_interfaces_without_keys_refuses_to_start(tmp_path):
    cmd = [sys.executable, "-m", "proxy.cli", "serve", "--host", "0.0.0.0"]
    cmd += ["--port", str(free_port()), "--cache-dir", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_PROMPT_CACHE_")}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "server.host '0.0.0.0' is not a loopback address" in done.stderr
    assert "[tenants] api_keys" in done.stderr and "--insecure" in done.stderr


def test_serve_insecure_starts_with_a_warning_and_still_checks_hosts(demo_root, tmp_path):
    server = start_server(
        fresh_cache_dir(demo_root, tmp_path / "c"),
        *("--host", "0.0.0.0", "--insecure", "--upstream", "http://127.0.0.1:9"),
    )
    try:
        assert "WARNING" in server.log() and "INSECURE: listening on 0.0.0.0" in server.log()
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200
        r = asyncio.run(
            raw_request(server.port, "GET", "/v1/models", [("Host", "attacker.example")])
        )
        assert r.status == 403
    finally:
        server.stop()


def test_serve_on_all_interfaces_with_keys_wants_the_key(demo_root, tmp_path):
    server = start_server(
        fresh_cache_dir(demo_root, tmp_path / "c"),
        *("--host", "0.0.0.0", "--upstream", "http://127.0.0.1:9"),
        env={"MLX_PROMPT_CACHE_TENANTS_API_KEYS": "sk-team=team"},
    )
    try:
        assert "INSECURE" not in server.log()
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401
        keyed = {"Authorization": "Bearer sk-team"}
        assert httpx.get(server.url + "/v1/models", headers=keyed, timeout=30).status_code == 200
    finally:
        server.stop()
