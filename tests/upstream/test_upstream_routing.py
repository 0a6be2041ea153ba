"""Through the real proxy, with a real mlx_lm.server playing LM Studio."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, fresh_cache_dir, start_server


def _start_mlx_server(model_dir, home):
    (home / "hub").mkdir(parents=True, exist_ok=True)  # its /v1/models scans the HF cache
    port = free_port()
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    log = open(home / "upstream.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    pytest.fail("mlx_lm.server did not start")


@pytest.fixture(scope="module")
def lm_studio_pair(demo_root, tmp_path_factory):
    """mlx_lm.server serving demo-swa as 'LM Studio'; the proxy serves demo-llama itself.

    One pair for the module: the test that stops the upstream comes last."""
    tmp_path = tmp_path_factory.mktemp("lm-studio-pair")
    upstream_proc, upstream_url = _start_mlx_server(
        demo_root / "models" / "demo-swa", tmp_path / "hf"
    )
    proxy = start_server(
        fresh_cache_dir(demo_root, tmp_path / "cache"),
        "--model",
        "demo-llama",
        "--upstream",
        upstream_url,
    )
    yield proxy, upstream_proc, upstream_url
    proxy.stop()
    upstream_proc.terminate()
    upstream_proc.wait(10)


def test_upstream_model_is_passed_through_and_local_model_served(lm_studio_pair):
    proxy, _, upstream_url = lm_studio_pair
    listed = httpx.get(proxy.url + "/v1/models", timeout=30).json()["data"]
    owners = {m["id"]: m["owned_by"] for m in listed}
    assert owners["demo-llama"] == "mlx-prompt-cache"
    upstream_ids = [
        m["id"] for m in httpx.get(upstream_url + "/v1/models", timeout=30).json()["data"]
    ]
    assert upstream_ids and all(i in owners for i in upstream_ids)
    model = upstream_ids[0]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    direct = httpx.post(upstream_url + "/v1/chat/completions", json=body, timeout=60).json()
    via = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
    assert via.status_code == 200
    assert "x-prompt-cache-source" not in via.headers  # the upstream answered, not us
    assert via.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    # Streaming passes through as SSE.
    with httpx.stream(
        "POST", proxy.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    # A route only LM Studio has is forwarded with its status.
    r = httpx.get(proxy.url + "/v1/no-such-route?x=1", timeout=30)
    assert (
        r.status_code == httpx.get(upstream_url + "/v1/no-such-route?x=1", timeout=30).status_code
    )
    # The local model is ours.
    local = httpx.post(
        proxy.url + "/v1/chat/completions", json={**body, "model": "demo-llama"}, timeout=60
    )
    assert local.headers["x-prompt-cache-source"] in ("none", "ram", "ssd")


def test_lmstudio_native_routes_serve_local_models_with_stats(lm_studio_pair):
    proxy, _, upstream_url = lm_studio_pair
    body = {
        "model": "demo-llama",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "temperature": 0,
    }
    r = httpx.post(proxy.url + "/api/v0/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    stats = r.json()["stats"]
    assert stats["stop_reason"] == "maxPredictedTokensReached"
    assert (
        stats["time_to_first_token"] > 0
        and stats["generation_time"] >= stats["time_to_first_token"]
    )
    assert stats["tokens_per_second"] > 0
    assert stats["prompt_cache_source"] in ("none", "ram", "ssd")
    with httpx.stream(
        "POST", proxy.url + "/api/v0/chat/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert '"stats"' in chunks[-1]
    r = httpx.post(
        proxy.url + "/api/v0/completions",
        json={"model": "demo-llama", "prompt": "The cache", "max_tokens": 4},
        timeout=60,
    )
    assert r.json()["stats"]["stop_reason"] == "maxPredictedTokensReached"
    models = httpx.get(proxy.url + "/api/v0/models", timeout=30).json()["data"]
    local = [m for m in models if m["id"] == "demo-llama"]
    assert local and local[0]["compatibility_type"] == "mlx" and local[0]["state"] == "loaded"


def test_upstream_down_gives_502_and_local_models_keep_working(lm_studio_pair):
    # Stops the module's upstream: the last test of the pair.
    proxy, upstream_proc, upstream_url = lm_studio_pair
    upstream_proc.terminate()
    upstream_proc.wait(10)
    r = httpx.post(proxy.url + "/v1/embeddings", json={"model": "x", "input": "y"}, timeout=30)
    assert r.status_code == 502
    assert upstream_url in r.json()["error"]["message"]
    time.sleep(2.1)  # the upstream model list is cached for ~2 s
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "gguf-only-model", "messages": [{"role": "user", "content": "x"}]},
        timeout=30,
    )
    assert r.status_code == 404
    assert "unreachable" in r.json()["error"]["message"]
    ok = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={
            "model": "demo-llama",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
        },
        timeout=60,
    )
    assert ok.status_code == 200
    models = httpx.get(proxy.url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["demo-llama"]


@pytest.fixture
def upstream_without_model_list(demo_root, tmp_path):
    """mlx_lm.server on demo-swa with no Hugging Face cache folder: /v1/models breaks."""
    home = tmp_path / "hf"
    model_dir = demo_root / "models" / "demo-swa"
    proc, url = _start_mlx_server(model_dir, home)
    (home / "hub").rmdir()  # the helper made it; without it scan_cache_dir raises
    proxy = start_server(
        fresh_cache_dir(demo_root, tmp_path / "cache"), "--model", "demo-llama", "--upstream", url
    )
    yield proxy, url, str(Path(model_dir).resolve())
    proxy.stop()
    proc.terminate()
    proc.wait(10)


def test_model_of_an_upstream_that_cannot_list_models_is_forwarded(upstream_without_model_list):
    proxy, upstream_url, upstream_model = upstream_without_model_list
    try:
        listed = httpx.get(upstream_url + "/v1/models", timeout=30)
        assert listed.status_code != 200 or not listed.content  # its list really is broken
    except httpx.HTTPError:
        pass
    body = {
        "model": upstream_model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    direct = httpx.post(upstream_url + "/v1/chat/completions", json=body, timeout=60)
    assert direct.status_code == 200
    via = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=60)
    assert via.status_code == 200, via.text
    assert "x-prompt-cache-source" not in via.headers  # the upstream answered, not us
    assert via.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    forwarded = [line for line in proxy.log().splitlines() if "forwarding since" in line]
    assert forwarded and "/v1/models returned no model list" in forwarded[0], proxy.log()
    # mlx_lm.server sends its own CORS headers; ours (CORS off) replace them.
    assert any(k.lower().startswith("access-control-") for k in direct.headers)
    assert not any(k.lower().startswith("access-control-") for k in via.headers)
    # Only our own models are listed, and local ones keep being served here.
    assert [m["id"] for m in httpx.get(proxy.url + "/v1/models", timeout=30).json()["data"]] == [
        "demo-llama"
    ]
    local = httpx.post(
        proxy.url + "/v1/chat/completions", json={**body, "model": "demo-llama"}, timeout=60
    )
    assert local.headers["x-prompt-cache-source"] in ("none", "ram", "ssd")
