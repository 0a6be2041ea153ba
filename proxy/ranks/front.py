"""The port clients use when a model is split across ranks: a relay to rank 0.

Rank 0 serves every route, dialect and the passthrough on a loopback port; this process
holds the port clients know, checks what the browser rules check (Host, Origin, API keys),
and passes each request on, streams included, byte for byte. It outlives the ranks: while
they are starting, or being started again after one was lost, a request gets a 503 in its
dialect's shape saying so, and one cut off by a lost rank ends with that 503 (or, once its
stream began, the dialect's in-band error) naming the rank. `/health` adds the ranks' state
to rank 0's answer. It loads no MLX (tests/ops/test_layout.py): the ranks hold the model.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from proxy.dialects.sse import SSEWriter
from proxy.errors import ApiError, dialect_for, error_response
from proxy.security import BrowserPolicy, browser_safety, setup_browser_safety
from proxy.upstream.headers import HOP_BY_HOP, REQUEST_ONLY_DROP, filtered
from proxy.upstream.relay import EventStream, mirror

from .supervisor import Supervisor, WorldState

log = logging.getLogger("proxy.ranks.front")

SUPERVISOR = web.AppKey("supervisor", Supervisor)
_HTTP = web.AppKey("rank0_http", aiohttp.ClientSession)
# Checked here: rank 0, on loopback, would judge them against its own address.
_CHECKED_HERE = frozenset({"origin", "referer"})
_RESPONSES_ROUTE = "/v1/responses"


@web.middleware
async def errors(request: web.Request, handler):
    """A refusal (`ApiError`) in the shape of the route's dialect."""
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except ApiError as err:
        status = err.status
        return error_response(err, dialect_for(request.path), err.headers)
    finally:
        log.info("%s %s %d %.0fms (front)", request.method, request.path, status,
                 (time.perf_counter() - started) * 1000)  # fmt: skip


def create_front(
    supervisor: Supervisor, policy: BrowserPolicy, max_body_bytes: int
) -> web.Application:
    app = web.Application(middlewares=[errors, browser_safety], client_max_size=max_body_bytes)
    app[SUPERVISOR] = supervisor
    setup_browser_safety(app, policy)
    app.cleanup_ctx.append(_client)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


async def _client(app: web.Application) -> AsyncIterator[None]:
    # No total timeout: a generation streams for as long as it runs.
    timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_connect=5)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as http:
        app[_HTTP] = http
        yield


async def health(request: web.Request) -> web.Response:
    """Rank 0's own answer with the ranks' state; 503 while they are not serving."""
    sup = request.app[SUPERVISOR]
    ranks = sup.state.to_json()
    if sup.state.state == "up" and sup.state.rank0_url:
        try:
            async with request.app[_HTTP].get(
                sup.state.rank0_url + "/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as r:
                body = await r.json()
                return web.json_response(body | {"ranks": ranks | body.get("ranks", {})},
                                         status=r.status)  # fmt: skip
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            ranks["rank0_error"] = str(e) or type(e).__name__
    # Up, as far as the launcher knows, but rank 0 did not answer: on its way down.
    status = "down" if sup.state.state == "up" else sup.state.state
    return web.json_response(
        {"status": status, "reason": sup.unavailable(), "ranks": ranks}, status=503
    )


async def relay(request: web.Request) -> web.StreamResponse:
    sup = request.app[SUPERVISOR]
    if sup.state.state != "up" or not sup.state.rank0_url:
        raise ApiError(503, sup.unavailable(), code="ranks_unavailable",
                       headers={"Retry-After": "5"})  # fmt: skip
    body = await request.read() if request.body_exists else None
    # A rank's end, reported by the launcher, cuts this relay at once: rank 0 may be stuck
    # in a step the lost rank never answers, and would only give up at the deadline.
    cut = _Cut(asyncio.current_task())
    sup.on_lost.add(cut)
    try:
        return await _relay(request, sup.state.rank0_url, body)
    except asyncio.CancelledError:
        if not cut.fired:
            raise  # the client left
        asyncio.current_task().uncancel()
        err = ApiError(503, await sup.lost(), code="rank_lost")
        started = request.get(_STARTED)
        if started is None:
            raise err from None
        await _fail(request, *started, err)
        return started[0]
    finally:
        sup.on_lost.discard(cut)


class _Cut:
    """Cancels one relay when the ranks are lost, and remembers it did."""

    def __init__(self, task: asyncio.Task | None):
        self.task, self.fired = task, False

    def __call__(self) -> None:
        self.fired = True
        if self.task is not None:
            self.task.cancel()


# Once rank 0's answer began: the response and, for an event stream, its events so far.
_STARTED = web.RequestKey("relay_started", tuple)


async def _relay(request: web.Request, rank0: str, body: bytes | None) -> web.StreamResponse:
    headers = filtered(request.headers, HOP_BY_HOP | REQUEST_ONLY_DROP | _CHECKED_HERE)
    try:
        upstream = await request.app[_HTTP].request(
            request.method, rank0 + request.path_qs, headers=headers, data=body,
            allow_redirects=False,
        )  # fmt: skip
    except (aiohttp.ClientError, TimeoutError) as e:
        log.warning("%s %s: rank 0 did not answer: %s", request.method, request.path, e)
        raise ApiError(503, await request.app[SUPERVISOR].lost(), code="rank_lost") from None

    async def copy(response: web.StreamResponse) -> bool:
        streaming = upstream.content_type == "text/event-stream"
        events = EventStream(responses=request.path == _RESPONSES_ROUTE) if streaming else None
        request[_STARTED] = (response, events)
        return await _copy(request, upstream, response, events)

    return await mirror(request, upstream, copy)


async def _copy(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    events: EventStream | None,
) -> bool:
    """Rank 0's body to the client; True when it was read to its end. When rank 0 is lost
    half way, an event stream ends with its dialect's error naming the rank."""
    try:
        async for chunk in upstream.content.iter_any():
            out = events.feed(chunk) if events is not None else chunk
            if out:
                await response.write(out)
        if events is not None and events.held:
            await response.write(bytes(events.held))
        if events is None or events.finished or upstream.status != 200:
            return True
    except ConnectionResetError:
        return False  # the client left: closing rank 0's side stops its generation
    except (aiohttp.ClientError, TimeoutError):
        pass
    err = ApiError(503, await request.app[SUPERVISOR].lost(), code="rank_lost")
    await _fail(request, response, events, err)
    return False


async def _fail(
    request: web.Request, response: web.StreamResponse, events: EventStream | None, err: ApiError
) -> None:
    """End a relayed answer that broke off: an event stream with its dialect's error, a
    plain body by cutting the connection (the client must see it truncated)."""
    log.warning("%s %s: the answer broke off: %s", request.method, request.path, err.message)
    if events is None:
        if request.transport is not None:
            request.transport.close()
        return
    try:
        if not events.at_boundary:
            await response.write(b"\n\n")
    except ConnectionError:
        return
    sse = SSEWriter(request, response=response)
    if events.responses:
        await sse.fail_response(err, events.response_id, events.next_sequence)
    else:
        await sse.fail(err, dialect_for(request.path))


def serve_front(config: Any, argv: list[str], policy: BrowserPolicy) -> int:
    """`serve` with [distributed] on: start the ranks, and relay the port to rank 0 until
    SIGINT or SIGTERM, which stops the ranks cleanly."""
    from engine_bridge.offline import LaunchError, Ranks, command, first_host_is_here

    d = config.distributed
    hostfile = Path(d.hostfile).expanduser() if d.hostfile else None
    ranks = Ranks(backend=d.backend, count=d.ranks or None, hostfile=hostfile, port=d.port)
    # Rank 0's own settings: on loopback beside this process, on a port of its own (the
    # last flags win); the environment's settings reach a remote rank through mlx.launch.
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    try:
        if hostfile is not None and not first_host_is_here(hostfile):
            raise LaunchError(f"hostfile {hostfile}: its first host must be this machine: "
                              "rank 0 answers HTTP on loopback beside this front")  # fmt: skip
        size = ranks.size()
        command(ranks, [], env)  # checks the hostfile and the rank count now
    except LaunchError as e:
        print(f"mlx-prompt-cache: {e}", file=sys.stderr)
        return 2

    def launch(port: int) -> list[str]:
        rank_argv = ["-m", "proxy.cli", *argv, "--host", "127.0.0.1", "--port", str(port)]
        return command(ranks, rank_argv, env)

    state = WorldState(size, d.mode, d.backend)
    supervisor = Supervisor(state, launch)
    app = create_front(supervisor, policy, config.server.max_body_bytes)
    asyncio.run(_serve(app, supervisor, config.server.host, config.server.port))
    if supervisor.fatal is not None:
        print(f"mlx-prompt-cache: the ranks refused to start: {supervisor.fatal}",
              file=sys.stderr)  # fmt: skip
        return 2
    return 0


ENV_PREFIX = "MLX_PROMPT_CACHE_"


async def _serve(app: web.Application, supervisor: Supervisor, host: str, port: int) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=10.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    print(f"mlx-prompt-cache serving on http://{host}:{port} (front of "
          f"{supervisor.state.size} ranks)", file=sys.stderr, flush=True)  # fmt: skip
    ranks = asyncio.create_task(supervisor.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # A stop, or the ranks refusing to start (supervisor.fatal): nothing left to serve.
    await asyncio.wait({asyncio.create_task(stop.wait()), ranks},
                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    log.info("stopping the ranks")
    await supervisor.stop()
    await ranks
    await runner.cleanup()
