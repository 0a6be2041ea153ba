"""One copy of the weights beside LM Studio: before the proxy loads a model in-process,
LM Studio unloads its own instances of the same model (proxy/upstream/one_copy.py).

The proxy (a real server, or the real app in-process), the model and LM Studio's API are
real; LM Studio is a fake that answers its documented REST shapes (tests/support/fake_lmstudio.py).
The model is the demo llama's folder copied to `<models>/acme/tiny-llama-mlx`, as LM
Studio keeps models, so it is served by path (demo models never match LM Studio's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.models.loading import ModelRef
from engine_bridge.models.preflight import Machine, RamReading, weights_bytes
from proxy.app import create_app
from proxy.config.model import Config, UpstreamConfig
from proxy.state import ProxySettings
from proxy.wiring import before_load_hook
from tests.conftest import REPO, fresh_cache_dir, start_server
from tests.support.fake_lmstudio import FakeLmStudio, FakeModel, lmstudio_model_folder

GB = 1 << 30
TOKEN = "lms-secret-token"
MODEL_ID = "acme/tiny-llama-mlx"  # our id: the folder relative to LM Studio's models dir
KEY = "tiny-llama-mlx"  # LM Studio's key, with "acme" as its publisher


@pytest.fixture
def lms_model(demo_root, tmp_path) -> tuple[Path, Path]:
    """(LM Studio's models dir, the model's folder in it)."""
    return lmstudio_model_folder(demo_root, tmp_path)


def _lm_studio_holding_it(**kw) -> FakeLmStudio:
    return FakeLmStudio(
        [
            FakeModel(KEY, "acme", 20 * GB, [KEY, f"{KEY}:2"]),
            FakeModel("qwen/qwen3-8b", "qwen", 5 * GB, ["qwen/qwen3-8b"], format="gguf"),
        ],
        **kw,
    )


def _config(tmp_path: Path, lms_model: tuple[Path, Path], upstream: str, **extra) -> Path:
    root, folder = lms_model
    lines = ["[upstream]", f'url = "{upstream}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in extra.items()]
    lines += ["[models]", f'serve = ["{folder}"]', f'lmstudio_dirs = ["{root}"]']
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _serve(demo_root, tmp_path, config: Path):
    return start_server(fresh_cache_dir(demo_root, tmp_path / "cache"), "--config", str(config))


def _chat(url: str) -> httpx.Response:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def _line(log: str, text: str) -> int:
    """The index of the first log line containing `text`."""
    lines = log.splitlines()
    return next(i for i, line in enumerate(lines) if text in line)


def _doctor(config: Path, port: int) -> dict:
    env = {**os.environ, "MLX_PROMPT_CACHE_SERVER_PORT": str(port)}
    cmd = [sys.executable, "-m", "proxy.cli", "doctor", "--config", str(config), "--json"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_loading_a_model_lm_studio_holds_unloads_its_instances_first(
    demo_root, tmp_path, lms_model
):
    with _lm_studio_holding_it(token=TOKEN) as fake:
        config = _config(tmp_path, lms_model, fake.url, api_token=TOKEN)
        server = _serve(demo_root, tmp_path, config)
        try:
            assert fake.unload_requests() == []  # models load on first use, not at start
            assert _chat(server.url).status_code == 200
            assert fake.unload_requests() == [KEY, f"{KEY}:2"]
            assert fake.loaded_instances(KEY) == []
            assert fake.loaded_instances("qwen/qwen3-8b") == ["qwen/qwen3-8b"]  # not ours
            assert {c.authorization for c in fake.calls} == {f"Bearer {TOKEN}"}
            # Loaded once: a second request asks LM Studio nothing.
            asked = len(fake.calls)
            assert _chat(server.url).status_code == 200
            assert len(fake.calls) == asked
            report = _doctor(config, server.port)
            # Requests passed through carry LM Studio's token, not the client's key for us.
            merged = httpx.get(server.url + "/v1/models", timeout=30,
                               headers={"Authorization": "Bearer for-the-proxy"})  # fmt: skip
            assert "qwen/qwen3-8b" in {m["id"] for m in merged.json()["data"]}
            v0 = httpx.get(server.url + "/api/v0/models", timeout=30).json()["data"]
            assert "qwen/qwen3-8b" in {m["id"] for m in v0}
            assert {c.authorization for c in fake.calls} == {f"Bearer {TOKEN}"}
        finally:
            server.stop()
    log = server.log()
    first = f"LM Studio held {KEY} (20.0 GB); unloaded instance {KEY} before loading it here"
    second = f"LM Studio held {KEY} (20.0 GB); unloaded instance {KEY}:2 before loading it here"
    assert " INFO " in log.splitlines()[_line(log, first)]
    assert _line(log, first) < _line(log, second) < _line(log, f"loaded model {MODEL_ID} from")
    # doctor sees the one copy: loaded here, and LM Studio holds only its other model.
    assert [(m["id"], m["loaded"]) for m in report["models"]] == [(MODEL_ID, True)]
    assert [m["key"] for m in report["lmstudio"]["loaded"]] == ["qwen/qwen3-8b"]


def test_unload_duplicates_false_leaves_lm_studio_alone(demo_root, tmp_path, lms_model):
    with _lm_studio_holding_it() as fake:
        config = _config(tmp_path, lms_model, fake.url, unload_duplicates=False)
        server = _serve(demo_root, tmp_path, config)
        try:
            assert _chat(server.url).status_code == 200
        finally:
            server.stop()
    assert [c.path for c in fake.calls if c.path.startswith("/api/")] == []
    assert fake.loaded_instances(KEY) == [KEY, f"{KEY}:2"]
    assert "LM Studio" not in server.log()


def test_a_refused_unload_is_a_warning_with_the_figures_and_the_request_is_served(
    demo_root, tmp_path, lms_model
):
    with _lm_studio_holding_it(refuse_unload=True) as fake:
        server = _serve(demo_root, tmp_path, _config(tmp_path, lms_model, fake.url))
        try:
            assert _chat(server.url).status_code == 200
        finally:
            server.stop()
    assert fake.unload_requests() == [KEY, f"{KEY}:2"]
    log = server.log()
    line = log.splitlines()[_line(log, f"LM Studio did not unload instance {KEY} of {KEY}")]
    assert " WARNING " in line
    assert "HTTP 403" in line and "unloading is not allowed right now" in line
    assert f"loading {MODEL_ID} here anyway, so this Mac holds two copies: 2 x 20.0 GB" in line
    assert " GB of RAM, " in line and " GB available now" in line
    assert _line(log, f"did not unload instance {KEY}:2") < _line(log, f"loaded model {MODEL_ID}")


def test_an_lm_studio_without_the_unload_api_is_a_warning_and_the_request_is_served(
    demo_root, tmp_path, lms_model
):
    with _lm_studio_holding_it(v0_only=True) as fake:
        server = _serve(demo_root, tmp_path, _config(tmp_path, lms_model, fake.url))
        try:
            assert _chat(server.url).status_code == 200
        finally:
            server.stop()
    assert [c.path for c in fake.calls if c.path.startswith("/api/")] == [
        "/api/v1/models",
        "/api/v0/models",
    ]
    log = server.log()
    line = log.splitlines()[_line(log, f"LM Studio at {fake.url} holds {KEY} loaded")]
    assert " WARNING " in line and "cannot unload it" in line
    # v0 gives no size: the figures are our own weights on disk.
    size = weights_bytes(lms_model[1]) / GB
    assert f"two copies: 2 x {size:.1f} GB of weights in " in line


def test_an_unreachable_lm_studio_is_a_warning_and_the_request_is_served(
    demo_root, tmp_path, lms_model
):
    config = _config(tmp_path, lms_model, "http://127.0.0.1:9")
    server = _serve(demo_root, tmp_path, config)
    try:
        assert _chat(server.url).status_code == 200
    finally:
        server.stop()
    log = server.log()
    line = log.splitlines()[_line(log, f"could not ask LM Studio whether it holds {MODEL_ID}")]
    assert " WARNING " in line and "unreachable at http://127.0.0.1:9" in line
    assert "If LM Studio has it loaded, this Mac holds two copies: 2 x " in line


class LmStudioBeside(Machine):
    """A 32 GB Mac whose system and apps use 6 GB, and a 20 GB model: one copy held by
    LM Studio while the fake lists an instance of it, one by us while the engine has it."""

    def __init__(self, engine: Engine, fake: FakeLmStudio):
        self.engine, self.fake = engine, fake

    def ram(self) -> RamReading:
        copies = bool(self.fake.loaded_instances(KEY)) + (
            self.engine.models.loaded(MODEL_ID) is not None
        )
        return RamReading(32 * GB, 26 * GB - copies * 20 * GB)

    def weights(self, ref: ModelRef) -> int:
        return 20 * GB


def _engine_beside(fake: FakeLmStudio, demo_root, tmp_path, lms_model, **upstream):
    root, folder = lms_model
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path / "cache"),
            model_specs=[str(folder)],
            lmstudio_dirs=[root],
            ssd_enabled=False,
            ram_budget_share=0.2,
        )
    )
    engine.models.preflight.machine = LmStudioBeside(engine, fake)
    config = Config(upstream=UpstreamConfig(url=fake.url, **upstream))
    engine.before_load = before_load_hook(config)
    return engine, config


async def test_on_a_32_gb_mac_with_lm_studio_holding_the_model_the_proxy_ends_with_one_copy(
    aiohttp_client, demo_root, tmp_path, lms_model
):
    with FakeLmStudio([FakeModel(KEY, "acme", 20 * GB, [KEY])]) as fake:
        engine, config = _engine_beside(fake, demo_root, tmp_path, lms_model)
        client = await aiohttp_client(create_app(engine, ProxySettings(), config.upstream))
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 4})
        assert r.status == 200, await r.text()
        assert fake.loaded_instances(KEY) == []  # LM Studio let go of its copy
        # The preflight read the memory after LM Studio's copy was gone: 26 GB free.
        assert engine.stats()["memory"]["last_load_available_bytes"] == 26 * GB
        listed = (await (await client.get("/v1/models")).json())["data"]
        assert {m["id"]: m["owned_by"] for m in listed}[MODEL_ID] == "mlx-prompt-cache"
        v0 = (await (await client.get("/api/v0/models")).json())["data"]
        states = {m["id"]: m["state"] for m in v0}  # ours, then LM Studio's
        assert states == {MODEL_ID: "loaded", KEY: "not-loaded"}  # one copy, here


async def test_without_the_unload_the_same_mac_refuses_the_second_copy(
    aiohttp_client, demo_root, tmp_path, lms_model
):
    with FakeLmStudio([FakeModel(KEY, "acme", 20 * GB, [KEY])]) as fake:
        engine, config = _engine_beside(
            fake, demo_root, tmp_path, lms_model, unload_duplicates=False
        )
        client = await aiohttp_client(create_app(engine, ProxySettings(), config.upstream))
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 4})
        assert r.status == 503  # the preflight: two copies do not fit in 32 GB
        assert "not enough memory to load" in (await r.json())["error"]["message"]
        assert fake.loaded_instances(KEY) == [KEY] and engine.models.loaded(MODEL_ID) is None
