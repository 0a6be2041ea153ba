"""SSD wear on a real server with a hybrid model: a held-back checkpoint reaches the disk
once it is due while the server sits idle (the SSD writer's tick has the MLX thread write
it, with the blocks under it), and a restart resumes there with the same greedy answer as
`x-prompt-cache: bypass`."""

from __future__ import annotations

import json
import struct
import time

import httpx

from tests.cache.test_cache_http import long_system
from tests.conftest import fresh_cache_dir, start_server

HYBRID = "demo-hybrid"
_WAIT_S = 120.0  # polls for a state the server reaches on its own, not timing


def chat(server, messages: list[dict], *, bypass: bool = False) -> httpx.Response:
    headers = {"x-prompt-cache": "bypass"} if bypass else {}
    # Thinking off: the prompt then ends past `<think></think>`, so its end is a plain
    # prompt-end checkpoint (held back), not the reply-open boundary (written at once).
    body = {"model": HYBRID, "messages": messages, "max_tokens": 8, "temperature": 0}
    body["chat_template_kwargs"] = {"enable_thinking": False}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r


def checkpoint_reasons(cache_dir) -> list[str]:
    """Why each checkpoint file on disk was saved, from its safetensors header."""
    reasons = []
    for path in cache_dir.glob("*/*/checkpoints/*/*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        reasons.append(header["__metadata__"]["cache.reason"])
    return sorted(reasons)


def test_a_due_checkpoint_is_written_while_idle_and_a_restart_resumes_there(demo_root, tmp_path):
    cache_dir = fresh_cache_dir(demo_root, tmp_path / "c")
    env = {"MLX_PROMPT_CACHE_CACHE_SSD_CHECKPOINT_WRITE_DELAY": "1s"}
    system = {"role": "system", "content": long_system(12, salt="Idle writes. ")}
    turn1 = [system, {"role": "user", "content": "Which report needs the region?"}]
    s = start_server(cache_dir, "--model", HYBRID, env=env)
    try:
        answer = chat(s, turn1).json()["choices"][0]["message"]["content"]
        # The first message boundary is written at once; the prompt end is held back
        # for a second, then written with no request coming to flush it.
        deadline = time.monotonic() + _WAIT_S
        while "prompt_end" not in checkpoint_reasons(cache_dir):
            assert time.monotonic() < deadline, f"no held-back checkpoint in {_WAIT_S:.0f} s"
            time.sleep(0.2)
        assert checkpoint_reasons(cache_dir) == ["boundary", "prompt_end"]
    finally:
        s.stop()
    turn2 = [*turn1, {"role": "assistant", "content": answer}]
    turn2.append({"role": "user", "content": "And who may delete a record?"})
    s = start_server(cache_dir, "--model", HYBRID, env=env)
    try:
        cached = chat(s, turn2)
        usage = cached.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] // 2
        assert cached.headers["x-prompt-cache-source"] == "ssd"
        cold = chat(s, turn2, bypass=True)
        assert cached.json()["choices"][0]["message"] == cold.json()["choices"][0]["message"]
    finally:
        s.stop()
