"""Images through a real server and the official SDKs, on demo-vision (issue 13).

Every cached answer is compared with the `x-prompt-cache: bypass` answer; hits are read
from `x-prompt-cache-hit-tokens` and checked against where the image's tokens start, found
with the model's own tokenizer (the rendered image pad is the first image token).
"""

from __future__ import annotations

import base64
import io
import itertools
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
from PIL import Image  # noqa: E402

from tests.conftest import fresh_cache_dir, start_server  # noqa: E402

MODEL = "demo-vision"
SYSTEM = (
    "You read screenshots that developers paste while they debug. Say what the screenshot "
    "shows, then the most likely cause of the problem, then one thing to try next."
)
_tenants = itertools.count()


def png(seed: int, width: int = 160, height: int = 120) -> str:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def image_block(seed: int) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": png(seed)},
    }


@pytest.fixture(scope="module")
def vision_root(tmp_path_factory) -> Path:
    from engine_bridge.models.demo import ensure_demo_model

    root = tmp_path_factory.mktemp("vision-http")
    ensure_demo_model(MODEL, root)
    return root


@pytest.fixture(scope="module")
def server(vision_root):
    config = vision_root / "config.toml"
    config.write_text("[vision]\nmax_images = 3\nmax_image_size = 2000000\n")
    s = start_server(
        vision_root, "--config", str(config), "--model", MODEL, "--upstream", "http://127.0.0.1:9"
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(vision_root):
    import mlx_lm.utils

    return mlx_lm.utils.load_tokenizer(vision_root / "models" / MODEL)


class Chat:
    """One tenant's conversation over the Anthropic SDK: nothing another test stored hits."""

    def __init__(self, server, tokenizer, model: str = MODEL):
        self.model = model
        self.connect(server)
        self.tokenizer = tokenizer
        self.tenant = f"vision-{next(_tenants)}"
        self.source = ""  # x-prompt-cache-source of the last answer

    def connect(self, server) -> None:
        """Talk to `server` from now on (a restarted one), as the same tenant."""
        self.client = anthropic.Anthropic(
            base_url=server.url, api_key="test", max_retries=0, timeout=120
        )

    def ask(
        self, messages: list[dict], bypass: bool = False, max_tokens: int = 12
    ) -> tuple[str, int, int]:
        headers = {"x-tenant": self.tenant}
        if bypass:
            headers["x-prompt-cache"] = "bypass"
        raw = self.client.messages.with_raw_response.create(
            model=self.model,
            system=SYSTEM,
            messages=messages,
            max_tokens=max_tokens,
            extra_body={"temperature": 0},
            extra_headers=headers,
        )
        msg = raw.parse()
        self.source = raw.headers["x-prompt-cache-source"]
        prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
        prompt += msg.usage.cache_creation_input_tokens or 0
        return msg.content[0].text, int(raw.headers["x-prompt-cache-hit-tokens"]), prompt

    def same_as_bypass(self, messages: list[dict]) -> tuple[str, int, int]:
        text, hit, prompt = self.ask(messages)
        assert text == self.ask(messages, bypass=True)[0]
        return text, hit, prompt

    def image_starts(self, messages: list[dict]) -> list[int]:
        """Token index of each image's first token in the prompt of `messages`."""
        pad = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        return [i for i, t in enumerate(self.rendered(messages)) if t == pad]

    def rendered(self, messages: list[dict]) -> list[int]:
        """The prompt's ids as the template renders it: one pad per image."""
        chat = [{"role": "system", "content": SYSTEM}]
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                content = [{"type": "image"} if b["type"] == "image" else b for b in content]
            chat.append({"role": m["role"], "content": content})
        text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text)


def test_image_at_the_start_hits_through_and_past_it_and_equals_bypass(server, tokenizer):
    chat = Chat(server, tokenizer)
    turn1 = [
        {"role": "user", "content": [image_block(1), {"type": "text", "text": "What is this?"}]}
    ]
    answer, hit, prompt1 = chat.same_as_bypass(turn1)
    assert hit == 0
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And what should I try next?"},
    ]
    _, hit, prompt2 = chat.same_as_bypass(turn2)
    (start,) = chat.image_starts(turn1)
    assert hit >= prompt1 - 1 > start  # through the image and the text after it
    assert prompt2 > prompt1


def test_image_in_the_middle_changed_image_misses_from_its_first_token(server, tokenizer):
    chat = Chat(server, tokenizer)
    history = [
        {
            "role": "user",
            "content": "My build fails on CI but passes locally. It started after I bumped "
            "the compiler and the test runner in the same commit, and only the integration "
            "job fails; the unit jobs are green. I already cleared the CI cache twice.",
        },
        {"role": "assistant", "content": "Can you show me the log?"},
    ]

    def turn(seed: int) -> list[dict]:
        shot = [{"type": "text", "text": "Here it is:"}, image_block(seed)]
        return history + [{"role": "user", "content": [*shot, {"type": "text", "text": "Why?"}]}]

    _, _, prompt = chat.same_as_bypass(turn(2))
    (start,) = chat.image_starts(turn(2))
    assert start > 64  # the text before the image spans full blocks
    _, hit, _ = chat.same_as_bypass(turn(2))
    assert hit == prompt - 1
    _, hit, _ = chat.same_as_bypass(turn(3))
    assert 0 < hit <= start  # the text before it hits, nothing from the image on
    _, hit, _ = chat.same_as_bypass(turn(2))  # the first image is still cached
    assert hit == prompt - 1


def test_image_in_a_tool_result_equals_bypass_and_hits_next_turn(server, tokenizer):
    chat = Chat(server, tokenizer)
    call = {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "captured"}, image_block(4)],
    }
    turn1 = [
        {"role": "user", "content": "Take a screenshot of the error dialog."},
        {"role": "assistant", "content": [call]},
        {"role": "user", "content": [result]},
    ]
    answer, _, prompt1 = chat.same_as_bypass(turn1)
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Thanks. Now fix it."},
    ]
    _, hit, _ = chat.same_as_bypass(turn2)
    assert hit >= prompt1 - 1
    other = [*turn1[:2], {"role": "user", "content": [{**result, "content": [image_block(5)]}]}]
    _, hit, _ = chat.same_as_bypass(other)
    assert hit < prompt1 - 1


def test_openai_data_url_equals_bypass_and_remote_url_is_refused(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=120)
    url = "data:image/png;base64," + png(6)
    messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What does this show?"},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        },
    ]
    answers = []
    for headers in ({"x-tenant": "oa"}, {"x-tenant": "oa"}, {"x-prompt-cache": "bypass"}):
        r = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_headers=headers
        )
        answers.append(
            (r.parse().choices[0].message.content, r.headers["x-prompt-cache-hit-tokens"])
        )
    assert answers[0][0] == answers[1][0] == answers[2][0]
    (entry,) = httpx.get(server.url + "/api/v0/models", timeout=30).json()["data"]
    assert (entry["id"], entry["type"], entry["state"]) == (MODEL, "vlm", "loaded")
    assert int(answers[1][1]) > 0
    remote = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}],
        }
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=remote, max_tokens=4)
    assert e.value.body["param"] == "messages[0].content[0].image_url.url"
    assert "does not fetch images from the network" in e.value.body["message"]


def test_bad_images_answer_4xx_naming_the_part(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0, timeout=120)

    def refused(content: list[dict], status: int = 400) -> str:
        messages = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": content},
        ]
        with pytest.raises(anthropic.APIStatusError) as e:
            client.messages.create(model=MODEL, messages=messages, max_tokens=4)
        assert e.value.status_code == status
        return e.value.body["error"]["message"]

    garbage = base64.b64encode(b"not an image at all").decode()
    bad = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": garbage},
    }
    msg = refused([{"type": "text", "text": "see"}, bad])
    assert msg.startswith("messages[2].content[1].source.data: not a decodable image")
    not_b64 = {**bad, "source": {**bad["source"], "data": "%%%"}}
    msg = refused([not_b64])
    assert msg == "messages[2].content[0].source.data: not valid base64"
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    msg = refused([url])
    assert msg.startswith("messages[2].content[0].source: this proxy does not fetch images")
    msg = refused([image_block(1), image_block(2), image_block(3), image_block(4)])
    assert msg.startswith(
        "messages[2].content[3].source.data: the request has 4 images, more than the 3"
    )
    big = base64.b64encode(b"\0" * 2_000_001).decode()
    huge = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": big}}
    msg = refused([huge], status=413)
    assert msg.startswith("messages[2].content[0].source.data: the image is 2000001 bytes")


def test_without_the_extra_images_get_a_400_naming_it(vision_root, tmp_path):
    # A package named mlx_vlm that fails to import stands in for the extra not installed.
    shadow = tmp_path / "shadow" / "mlx_vlm"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    s = start_server(
        fresh_cache_dir(vision_root, tmp_path / "cache"),
        "--model",
        MODEL,
        "--upstream",
        "http://127.0.0.1:9",
        log_path=tmp_path / "server.log",
        env={"PYTHONPATH": str(shadow.parent)},
    )
    try:
        client = anthropic.Anthropic(base_url=s.url, api_key="test", max_retries=0, timeout=120)
        text = client.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert text.content[0].text  # text-only still serves
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(
                model=MODEL,
                messages=[{"role": "user", "content": [image_block(1)]}],
                max_tokens=4,
            )
        msg = e.value.body["error"]["message"]
        assert msg.startswith(
            "messages[0].content[0].source.data: model 'demo-vision' has a vision tower"
        )
        assert "pip install 'mlx-prompt-cache[vision]'" in msg
        entry = httpx.get(s.url + "/api/v0/models", timeout=30).json()["data"][0]
        assert (entry["id"], entry["type"], entry["state"]) == (MODEL, "llm", "loaded")
    finally:
        s.stop()


def test_image_and_text_requests_decode_in_one_batch_each_as_alone(server, tokenizer):
    """Each batch row shifts its positions by its own prompt's RoPE delta."""
    import concurrent.futures

    def conversation(i: int) -> list[dict]:
        if i == 2:
            return [{"role": "user", "content": "Only text here, no screenshot at all."}]
        shot = [{"type": "text", "text": f"Screenshot {i}:"}, image_block(10 + i)]
        return [{"role": "user", "content": shot}]

    chats = [Chat(server, tokenizer) for _ in range(3)]
    # Long enough answers that the three overlap in decoding.
    alone = [c.ask(conversation(i), True, 160)[0] for i, c in enumerate(chats)]
    before = httpx.get(server.url + "/v1/cache/stats").json()["scheduler"]["decode_tokens"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(c.ask, conversation(i), False, 160) for i, c in enumerate(chats)]
        together = [f.result()[0] for f in futures]
    assert together == alone
    stats = httpx.get(server.url + "/v1/cache/stats").json()["scheduler"]
    assert stats["largest_batch"] >= 2, stats
    assert stats["decode_tokens"] > before


def test_the_served_answer_is_mlx_vlms_own_greedy_generation(server, tokenizer, vision_root):
    """Not only cached == bypass: both equal mlx-vlm decoding with its own positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine_bridge.types import ImageInput
    from engine_bridge.vision import model as vision
    from engine_bridge.vision import prompt as vp

    chat = Chat(server, tokenizer)
    messages = [
        {"role": "user", "content": "Something broke after the upgrade."},
        {"role": "assistant", "content": "Show me."},
        {"role": "user", "content": [image_block(20), {"type": "text", "text": "This."}]},
    ]
    served = chat.ask(messages, bypass=True, max_tokens=16)[0]
    model, _ = vision.load(vision_root / "models" / MODEL)
    rendered = [{"role": "system", "content": SYSTEM}, *messages[:2]]
    rendered.append(
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "This."}]}
    )
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    )
    data = base64.b64decode(image_block(20)["source"]["data"])
    image = vp.preprocess(ImageInput(data, "image/png", "x"), model.spec, vp.VisionLimits())
    _, _, prompt = vp.expand(ids, [0], [image], model.spec)
    cache = make_prompt_cache(model)
    logits = model.vlm(
        mx.array([prompt.model_tokens]),
        pixel_values=mx.array(image.pixel_values),
        image_grid_thw=mx.array([list(image.grid_thw)]),
        cache=cache,
    ).logits
    out = []
    for _ in range(16):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model.lm(mx.array([[out[-1]]]), cache=cache).logits
    assert served == tokenizer.decode(out)


def turn_two_after_a_restart(root, tokenizer, tmp_path, model: str = MODEL):
    """Turn 1 with an image on one server, turn 2 on another started over the same folder;
    turn 2 must come from SSD and equal bypass. Returns the chat, turn 1, turn 1's prompt
    tokens and turn 2's hit tokens."""
    cache = fresh_cache_dir(root, tmp_path / "cache")
    args = ("--model", model, "--upstream", "http://127.0.0.1:9")
    turn1 = [{"role": "user", "content": [image_block(30), {"type": "text", "text": "What now?"}]}]
    first = start_server(cache, *args, log_path=tmp_path / "first.log")
    try:
        chat = Chat(first, tokenizer, model)
        answer, _, prompt1 = chat.ask(turn1)
    finally:
        assert first.stop() == 0
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Go on."},
    ]
    second = start_server(cache, *args, log_path=tmp_path / "second.log")
    try:
        chat.connect(second)
        text, hit, _ = chat.ask(turn2)
        assert chat.source == "ssd"
        assert text == chat.ask(turn2, bypass=True)[0]
    finally:
        second.stop()
    return chat, turn1, prompt1, hit


def test_a_restarted_server_resumes_past_the_image_from_ssd(vision_root, tokenizer, tmp_path):
    """Image keys are content hashes, the same in every process: SSD blocks still match."""
    _, _, prompt1, hit = turn_two_after_a_restart(vision_root, tokenizer, tmp_path)
    assert hit >= prompt1 - 1
