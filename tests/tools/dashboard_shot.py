"""The README's dashboard screenshot: a demo proxy, some agent-like traffic, then Chromium.

    python -m tests.tools.dashboard_shot [--out docs/dashboard.png] [--seconds 40]

Starts a proxy on the demo models (upstream off, a 12 MB RAM tier and a 64 MB SSD tier so
the meters and spills show), opens /dashboard in Debian's chromium through Playwright, and
sends traffic while the page polls: three agent sessions that grow turn by turn over a
shared system prompt (OpenAI and Anthropic SDKs), one whose history is edited, a bypassed
request, a pinned session, and at the end a burst of new conversations that drops the hit
ratio of the last 20 requests and raises the alert. Then it saves a full-page screenshot.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import anthropic
import httpx
import openai

from tests.conftest import DEMO_IDS, REPO, start_server

SYSTEM = (
    "You are a coding agent working in a large repository. Read files before editing them, "
    "run the tests after each change, and explain what you did in one short paragraph. "
) * 6
TOPICS = ("the SSD tier", "session pinning", "checkpoint eviction", "the request log")


def traffic(url: str, seconds: float) -> None:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0, timeout=120)
    an = anthropic.Anthropic(base_url=url, api_key="demo", max_retries=0, timeout=120)
    histories: dict[str, list[dict]] = {"claude-code-7f3a": [], "qwen-code-19b2": []}
    agent_turns: list[dict] = []
    end = time.monotonic() + seconds
    turn = 0
    while time.monotonic() < end:
        for sid, history in histories.items():
            history.append({"role": "user", "content": f"Turn {turn}: look at {TOPICS[turn % 4]}."})
            r = oa.chat.completions.create(
                model="demo-llama" if sid.startswith("claude") else "demo-hybrid",
                messages=[{"role": "system", "content": SYSTEM}, *history],
                max_tokens=8,
                temperature=0,
                extra_headers={"x-session-id": sid},
            )
            history.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        agent_turns.append({"role": "user", "content": f"Step {turn}: summarise the diff."})
        m = an.messages.create(
            model="demo-swa",
            system=SYSTEM,
            messages=agent_turns,
            max_tokens=8,
            metadata={"user_id": "anthropic-agent-42"},
            extra_body={"temperature": 0},
        )
        agent_turns.append({"role": "assistant", "content": m.content[0].text or "ok"})
        turn += 1
        time.sleep(1.5)
    # History edited: the second message of a session changes, so the cache stops there.
    edited = histories["claude-code-7f3a"]
    edited[0] = {"role": "user", "content": "Turn 0 (edited): look at the dashboard."}
    oa.chat.completions.create(
        model="demo-llama",
        messages=[{"role": "system", "content": SYSTEM}, *edited],
        max_tokens=8,
        extra_headers={"x-session-id": "claude-code-7f3a"},
    )
    oa.chat.completions.create(
        model="demo-llama",
        messages=[{"role": "user", "content": "A one-off comparison run."}],
        max_tokens=8,
        extra_headers={"x-prompt-cache": "bypass"},
    )
    r = httpx.post(url + "/v1/cache/sessions/claude-code-7f3a/pin", timeout=30)
    assert r.status_code == 200, r.text
    time.sleep(4)
    for i in range(20):  # new conversations, nothing to hit: the alert goes up
        oa.chat.completions.create(
            model="demo-llama",
            messages=[{"role": "user", "content": f"Unrelated question {i}: " + "why? " * 30}],
            max_tokens=4,
            extra_headers={"x-session-id": f"one-off-{i:02d}"},
        )
        time.sleep(0.2)


def shrink(path: Path) -> None:
    """128 colours, no dithering: a third of the bytes for a page of flat colours and text."""
    try:
        from PIL import Image  # with the bench extra (matplotlib)
    except ImportError:
        return
    image = Image.open(path).convert("RGB")
    image.quantize(128, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        path, optimize=True
    )


def main(argv: list[str] | None = None) -> int:
    from playwright.sync_api import sync_playwright

    from engine_bridge.models.demo import ensure_demo_model

    parser = argparse.ArgumentParser(prog="dashboard_shot", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    parser.add_argument("--seconds", type=float, default=40.0, help="of agent traffic")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium")
    if chromium is None:
        parser.error("needs Debian's chromium on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp)
        for name in DEMO_IDS:
            ensure_demo_model(name, cache)
        env = {
            "MLX_PROMPT_CACHE_UPSTREAM_ENABLED": "false",
            "MLX_PROMPT_CACHE_CACHE_RAM_BUDGET": "12MB",
            "MLX_PROMPT_CACHE_CACHE_SSD_MAX_SIZE": "64MB",
        }
        server = start_server(cache, env=env)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium)
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.goto(server.url + "/dashboard")
                traffic(server.url, args.seconds)
                page.wait_for_timeout(4500)  # two more polls
                args.out.parent.mkdir(parents=True, exist_ok=True)
                # The top of the page: cards, charts, sessions and the newest requests.
                clip = {"x": 0, "y": 0, "width": 1400, "height": 1800}
                page.screenshot(path=str(args.out), full_page=True, clip=clip)
                browser.close()
        finally:
            server.stop()
    shrink(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
