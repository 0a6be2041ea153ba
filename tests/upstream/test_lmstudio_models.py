"""GET /api/v0/models when the upstream cannot list its models: the local list, and one
warning that names the upstream URL and what went wrong (no traceback), not silence.

The real app on a real engine (nothing loaded); the upstream is a closed port, or a real
aiohttp server answering garbage.
"""

from __future__ import annotations

import logging
import socket

import pytest
from aiohttp import web

from engine_bridge.engine import Engine, EngineSettings
from proxy.app import create_app
from proxy.config.model import UpstreamConfig
from proxy.state import ProxySettings
from tests.conftest import fresh_cache_dir

MODEL = "demo-llama"
LOGGER = "proxy.dialects.lmstudio"


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
def proxy(aiohttp_client, engine):
    async def start(upstream: str):
        config = UpstreamConfig(url=upstream, connect_timeout_s=1.0)
        return await aiohttp_client(create_app(engine, ProxySettings(), config))

    return start


async def upstream_answering(aiohttp_server, body: bytes, status: int = 200) -> str:
    async def models(request: web.Request) -> web.Response:
        return web.Response(body=body, status=status, content_type="application/json")

    app = web.Application()
    app.router.add_get("/api/v0/models", models)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def listed_ids(client) -> list[str]:
    r = await client.get("/api/v0/models")
    assert r.status == 200
    return [d["id"] for d in (await r.json())["data"]]


def warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


async def test_an_unreachable_upstream_is_one_warning_and_the_local_list(proxy, caplog):
    url = closed_port_url()
    client = await proxy(url)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert await listed_ids(client) == [MODEL]
        assert await listed_ids(client) == [MODEL]  # polled again: the same failure
    [warning] = warnings(caplog)
    message = warning.getMessage()
    assert message.startswith(
        f"/api/v0/models lists the local models only: GET {url}/api/v0/models failed: "
    ), message
    assert "Cannot connect" in message or "refused" in message, message
    assert warning.exc_info is None  # a plain connection error: no traceback
    repeats = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.DEBUG]
    assert [r.getMessage() for r in repeats] == [message]


@pytest.mark.parametrize(
    "body,why",
    [
        (b"<html>LM Studio</html>", "returned no model list: JSONDecodeError("),
        (b"[1, 2]", "returned no model list: TypeError("),
        (b'{"models": []}', "returned no model list: KeyError('data')"),
    ],
    ids=["html", "array", "no-data"],
)
async def test_an_upstream_answering_garbage_is_a_warning_and_the_local_list(
    proxy, aiohttp_server, caplog, body, why
):
    url = await upstream_answering(aiohttp_server, body)
    client = await proxy(url)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await listed_ids(client) == [MODEL]
    [warning] = warnings(caplog)
    assert f"GET {url}/api/v0/models {why}" in warning.getMessage(), warning.getMessage()
    assert warning.exc_info is None


async def test_an_upstream_error_status_is_named_and_a_good_list_is_merged(
    proxy, aiohttp_server, caplog
):
    failing = await upstream_answering(aiohttp_server, b"{}", status=503)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await listed_ids(await proxy(failing)) == [MODEL]
    [warning] = warnings(caplog)
    assert warning.getMessage().endswith(f"GET {failing}/api/v0/models answered HTTP 503")
    good = await upstream_answering(
        aiohttp_server, b'{"data": [{"id": "qwen3-gguf"}, 5, {"id": "demo-llama"}]}'
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert await listed_ids(await proxy(good)) == [MODEL, "qwen3-gguf"]
    assert warnings(caplog) == []
