"""The shared Redis tier under a split model (issue 34): each rank stores its slice under
its own layout's name, so a second split world on another cache folder restores every
rank's slice from the store (`x-prompt-cache-source: shared`, the same greedy answer as
bypass), and a whole model on the same store never takes a rank's slice for its own."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import free_ports, fresh_cache_dir, start_server
from tests.support.redis_helpers import redis_fixture

SYSTEM = "You are a careful assistant who answers briefly and plainly. " * 10
QUESTION = "Name three rivers."


@pytest.fixture(scope="module")
def redis_store(tmp_path_factory):
    yield from redis_fixture(tmp_path_factory.mktemp("redis"))


def _serve(demo_root, tmp_path_factory, name: str, url: str, *ranks: str):
    env = {
        "MLX_PROMPT_CACHE_CACHE_SHARED_URL": url,
        "MLX_PROMPT_CACHE_CACHE_SHARED_WRITE_POLICY": "all",
        "MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "0",
        "MLX_PROMPT_CACHE_DISTRIBUTED_PORT": str(free_ports(2)),
    }
    cache = fresh_cache_dir(demo_root, tmp_path_factory.mktemp(name))
    return start_server(cache, "--upstream", "http://127.0.0.1:9", "--model", "demo-hybrid",
                        *ranks, env=env)  # fmt: skip


def _ask(server, bypass: bool = False) -> tuple[str, str | None, int]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="t", max_retries=0, timeout=120)
    r = client.chat.completions.with_raw_response.create(
        model="demo-hybrid",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
        extra_headers={"x-prompt-cache": "bypass"} if bypass else {},
    )
    message = r.parse().choices[0].message
    text = (getattr(message, "reasoning_content", None) or "") + "|" + (message.content or "")
    return text, r.headers.get("x-prompt-cache-source"), int(r.headers["x-prompt-cache-hit-tokens"])


def test_every_rank_restores_its_slice_from_the_shared_store(
    demo_root, tmp_path_factory, redis_store
):
    a = _serve(demo_root, tmp_path_factory, "split-a", redis_store.url, "--ranks", "2")
    try:
        computed = _ask(a)
    finally:
        assert a.stop(timeout=60) == 0  # every rank sends what it queued for the store
    whole = _serve(demo_root, tmp_path_factory, "whole", redis_store.url)
    try:
        alone = _ask(whole)
        # A rank's slice is no state of the whole model: nothing of it is restored here.
        assert alone[2] == 0 and alone[1] == "none", alone
        stats = httpx.get(whole.url + "/v1/cache/stats", timeout=30).json()["shared"]
        assert stats["hits"] == 0 and stats["promoted_entries"] == 0, stats
    finally:
        whole.stop()
    b = _serve(demo_root, tmp_path_factory, "split-b", redis_store.url, "--ranks", "2")
    try:
        restored = _ask(b)
        assert restored[1] == "shared" and restored[2] > 0, restored
        assert restored[0] == computed[0] == _ask(b, bypass=True)[0]
    finally:
        b.stop(timeout=60)
