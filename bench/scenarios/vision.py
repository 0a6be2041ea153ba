"""The vision scenario (issue 13): a chat whose turn 2 pastes a screenshot-sized image.

Every later turn resends the image, as clients do. With the cache, turns 3..N should cost
only their new text; without it, every turn decodes, resizes and encodes the image again and
prefills the whole conversation. Runs on the given model when it can see, else demo-vision.
mlx_lm.server is text-only, so it is not in this scenario; mlx-vlm's own server is, with its
automatic prefix cache on (APC_ENABLED=1), sent the same OpenAI requests.
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

from .. import traces
from ..harness import Harness, Settings, stats
from ..results import Row, ScenarioResult, mean, ratio
from ..servers import ModelSpec

KINDS = ("ours", "nocache", "mlx_vlm")
IMAGE_TURN = 1  # 0-based: the second user turn
WIDTH, HEIGHT = 1920, 1080


def screenshot_png(seed: int) -> bytes:
    """A deterministic 1080p image that looks like an editor: panels, lines of 'text'."""
    import numpy as np
    from PIL import Image

    rng = random.Random(f"vision/{seed}")
    img = np.full((HEIGHT, WIDTH, 3), 30, np.uint8)
    img[:, :260] = 45  # a sidebar
    img[:40] = 60  # a tab bar
    for y in range(60, HEIGHT - 20, 22):
        x0 = 280 + 24 * rng.randint(0, 4)
        x1 = min(WIDTH - 40, x0 + rng.randint(200, 1300))
        color = rng.choice(((200, 200, 200), (120, 180, 250), (230, 160, 90), (140, 200, 120)))
        img[y : y + 12, x0:x1] = color
    out = io.BytesIO()
    Image.fromarray(img).save(out, "PNG")
    return out.getvalue()


def _messages(trace: traces.ChatTrace, turn: int, data_url: str) -> list[dict[str, Any]]:
    out = trace.messages(turn)
    if turn >= IMAGE_TURN:
        user = out[1 + 2 * IMAGE_TURN]
        assert user["role"] == "user", user
        user["content"] = [
            {"type": "text", "text": "Here is a screenshot of what I see:"},
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "text", "text": user["content"]},
        ]
    return out


def vision(settings: Settings, model: ModelSpec) -> ScenarioResult:
    from engine_bridge.vision.prompt import vision_status

    from ..harness import resolve_model

    # mlx-vlm is installed: run_one skips this scenario otherwise (prerequisites.NEEDS).
    if vision_status(_config(model)) != "yes":
        model = resolve_model("demo-vision", settings.out / "models")
    result = ScenarioResult("vision", model.id)
    turns = settings.size(4, 10)
    trace = traces.chat_trace(settings.seed, turns, settings.size(300, 2000))
    url = "data:image/png;base64," + base64.b64encode(screenshot_png(settings.seed)).decode()
    result.metrics["image_bytes"] = len(url)
    with Harness(settings, result, model) as h:
        for kind in KINDS:
            with h.serve(kind) as server:
                for t in range(turns):
                    body = {"messages": _messages(trace, t, url)}
                    sample = h.send(server, "openai", body, t)
                    h.progress(f"turn {t + 1}/{turns}", server, sample)
                if kind == "ours":
                    result.metrics["ram_bytes_after"] = stats(server).get("ram", {}).get("bytes")
    _summarize(result, turns)
    return result.finish()


def _config(model: ModelSpec) -> dict[str, Any]:
    import json

    try:
        return json.loads((model.path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _summarize(result: ScenarioResult, turns: int) -> None:
    ttft = {k: [s.ttft_s for s in result.of(k)] for k in KINDS}
    after = {k: mean(v[IMAGE_TURN + 1 :]) for k, v in ttft.items()}
    result.rows.append(
        Row(
            f"mean TTFT of turns {IMAGE_TURN + 2}..{turns}, after the image (s)",
            after,
            _ratios(after),
        )
    )
    for t in range(turns):
        values = {k: v[t] if t < len(v) else None for k, v in ttft.items()}
        result.rows.append(
            Row(
                f"TTFT of turn {t + 1}{' (image)' if t == IMAGE_TURN else ''} (s)",
                values,
                _ratios(values),
            )
        )
    hits = {}
    for kind in ("ours", "mlx_vlm"):
        samples = [s for s in result.of(kind) if s.prompt_tokens]
        hits[kind] = ratio(
            sum(s.cached_tokens or 0 for s in samples), sum(s.prompt_tokens for s in samples)
        )
    result.rows.append(Row("token hit ratio (cached / prompt tokens)", hits))
    for other in ("nocache", "mlx_vlm"):
        runs = zip(result.of("ours"), result.of(other), strict=False)
        pairs = [(a.output, b.output) for a, b in runs if a.ok and b.ok]
        key = f"greedy_outputs_equal_ours_vs_{other}"
        result.metrics[key] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
        # mlx-lm's detokenizer (ours, mlx_lm.server's) drops a reply's first space and
        # mlx-vlm's keeps it: the same tokens, told apart by that alone.
        same = [a.lstrip(" ") == b.lstrip(" ") for a, b in pairs]
        result.metrics[key + "_but_a_leading_space"] = sum(same) / len(same) if same else None


def _ratios(values: dict[str, float | None]) -> dict[str, float | None]:
    return {
        "no-cache / ours": ratio(values["nocache"], values["ours"]),
        "mlx_vlm.server / ours": ratio(values.get("mlx_vlm"), values["ours"]),
    }
