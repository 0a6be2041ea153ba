"""A fake LM Studio: a real aiohttp server, on a free port in a thread of its own, that
answers LM Studio's REST API in the documented shapes and records what it was asked.

`GET /api/v1/models` and `POST /api/v1/models/unload` (LM Studio 0.4+), or with
`v0_only` just `GET /api/v0/models` (0.3.x: 404 on /api/v1); `GET /v1/models` (OpenAI)
always. With `token` set, a request without `Authorization: Bearer <token>` gets a 401;
with `refuse_unload`, an unload gets a 403 and changes nothing.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.conftest import free_port


def lmstudio_model_folder(demo_root: Path, dest: Path, name: str = "acme/tiny-llama-mlx"):
    """(an LM Studio models dir under `dest`, a model folder `<publisher>/<model>` in it
    holding the demo llama's files): a real model that is not a demo model by its path."""
    root = dest / "lmstudio-models"
    folder = root / name
    shutil.copytree(demo_root / "models" / "demo-llama", folder)
    return root, folder


@dataclass
class FakeModel:
    key: str
    publisher: str
    size_bytes: int = 1 << 30
    instances: list[str] = field(default_factory=list)
    format: str = "mlx"
    type: str = "llm"


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    authorization: str | None
    body: dict | None
    at: float  # time.time()


class FakeLmStudio:
    def __init__(
        self,
        models: list[FakeModel],
        token: str | None = None,
        refuse_unload: bool = False,
        v0_only: bool = False,
    ):
        self.models = models
        self.token = token
        self.refuse_unload = refuse_unload
        self.v0_only = v0_only
        self.calls: list[Call] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the engine's thread reads the state too

    # -- state the tests read ------------------------------------------------------------

    def unload_requests(self) -> list[str]:
        """The instance ids unloads were asked for, in order (refused ones too)."""
        return [c.body["instance_id"] for c in self.calls if c.path == "/api/v1/models/unload"]

    def loaded_instances(self, key: str) -> list[str]:
        with self._lock:
            return next((list(m.instances) for m in self.models if m.key == key), [])

    # -- the server ------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        return self.token is None or request.headers.get("Authorization") == f"Bearer {self.token}"

    @web.middleware
    async def _record(self, request: web.Request, handler):
        body = await request.json() if request.can_read_body else None
        self.calls.append(
            Call(
                request.method,
                request.path,
                request.headers.get("Authorization"),
                body,
                time.time(),
            )
        )
        if not self._authorized(request):
            return web.json_response({"error": "Invalid or missing API token"}, status=401)
        return await handler(request)

    async def _v1_models(self, request: web.Request) -> web.Response:
        if self.v0_only:
            raise web.HTTPNotFound()
        with self._lock:
            models = [
                {
                    "type": m.type,
                    "publisher": m.publisher,
                    "key": m.key,
                    "display_name": m.key,
                    "architecture": "llama",
                    "quantization": {"name": "4bit", "bits_per_weight": 4},
                    "size_bytes": m.size_bytes,
                    "params_string": "1B",
                    "loaded_instances": [
                        {"id": i, "config": {"context_length": 4096}} for i in m.instances
                    ],
                    "max_context_length": 32768,
                    "format": m.format,
                    "capabilities": {"vision": False, "trained_for_tool_use": True},
                    "description": None,
                }
                for m in self.models
            ]
        return web.json_response({"models": models})

    async def _unload(self, request: web.Request) -> web.Response:
        if self.v0_only:
            raise web.HTTPNotFound()
        instance = (await request.json()).get("instance_id")
        if self.refuse_unload:
            return web.json_response(
                {"error": {"message": "unloading is not allowed right now"}}, status=403
            )
        with self._lock:
            for m in self.models:
                if instance in m.instances:
                    m.instances.remove(instance)
                    return web.json_response({"instance_id": instance})
        return web.json_response({"error": f"no loaded instance {instance!r}"}, status=404)

    async def _v0_models(self, request: web.Request) -> web.Response:
        with self._lock:
            data = [
                {
                    "id": m.key,
                    "object": "model",
                    "type": m.type,
                    "publisher": m.publisher,
                    "arch": "llama",
                    "compatibility_type": m.format,
                    "quantization": "4bit",
                    "state": "loaded" if m.instances else "not-loaded",
                    "max_context_length": 32768,
                }
                for m in self.models
            ]
        return web.json_response({"object": "list", "data": data})

    async def _openai_models(self, request: web.Request) -> web.Response:
        data = [{"id": m.key, "object": "model", "owned_by": m.publisher} for m in self.models]
        return web.json_response({"object": "list", "data": data})

    def __enter__(self) -> FakeLmStudio:
        ready = threading.Event()
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/api/v1/models", self._v1_models)
        app.router.add_post("/api/v1/models/unload", self._unload)
        app.router.add_get("/api/v0/models", self._v0_models)
        app.router.add_get("/v1/models", self._openai_models)

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            runner = web.AppRunner(app)
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="fake-lmstudio", daemon=True)
        self._thread.start()
        assert ready.wait(10), "the fake LM Studio did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._thread is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
