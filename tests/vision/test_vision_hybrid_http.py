"""Images on a hybrid vision model (issue 13 item 5), through a real server and the SDKs.

demo-vision-hybrid is a tiny Qwen3.5: Gated DeltaNet layers carry recurrent state, so its
cache restores only at checkpoints. A later turn must resume from a checkpoint past the
image, and cached greedy output must equal `x-prompt-cache: bypass` output.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytest.importorskip("mlx_vlm")

from tests.conftest import start_server  # noqa: E402
from tests.vision.test_vision_http import Chat, image_block, turn_two_after_a_restart  # noqa: E402

MODEL = "demo-vision-hybrid"


@pytest.fixture(scope="module")
def hybrid_root(tmp_path_factory) -> Path:
    from engine_bridge.models.demo import ensure_demo_model

    root = tmp_path_factory.mktemp("vision-hybrid-http")
    ensure_demo_model(MODEL, root)
    return root


@pytest.fixture(scope="module")
def server(hybrid_root):
    s = start_server(hybrid_root, "--model", MODEL, "--upstream", "http://127.0.0.1:9")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(hybrid_root):
    import mlx_lm.utils

    return mlx_lm.utils.load_tokenizer(hybrid_root / "models" / MODEL)


def image_end(chat: Chat, messages: list[dict], prompt: int) -> int:
    """One past the image's last token, from the served prompt length (one pad per image
    in the rendered template, the image's tokens in the prompt)."""
    (start,) = chat.image_starts(messages)
    return start + prompt - (len(chat.rendered(messages)) - 1)


def test_a_later_turn_resumes_past_the_image_from_a_checkpoint_and_equals_bypass(server, tokenizer):
    chat = Chat(server, tokenizer, MODEL)
    turn1 = [
        {"role": "user", "content": [image_block(1), {"type": "text", "text": "What is this?"}]}
    ]
    answer, hit, prompt1 = chat.same_as_bypass(turn1)
    assert hit == 0
    end = image_end(chat, turn1, prompt1)
    assert end - chat.image_starts(turn1)[0] >= 4  # the image is several tokens
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And what should I try next?"},
    ]
    answer2, hit, prompt2 = chat.same_as_bypass(turn2)
    assert end < hit < prompt2  # resumed from a checkpoint past the image
    turn3 = turn2 + [
        {"role": "assistant", "content": answer2},
        {"role": "user", "content": "Is that all?"},
    ]
    _, hit3, _ = chat.same_as_bypass(turn3)
    assert hit3 > prompt2 - 16 > hit


def test_a_changed_image_misses_from_its_first_token(server, tokenizer):
    chat = Chat(server, tokenizer, MODEL)
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
    _, hit, _ = chat.same_as_bypass(turn(2))
    assert image_end(chat, turn(2), prompt) < hit < prompt
    _, hit, _ = chat.same_as_bypass(turn(3))
    assert 0 < hit <= start  # a checkpoint before the image, nothing from the image on
    _, hit, _ = chat.same_as_bypass(turn(2))  # the first image's chain is still cached
    assert image_end(chat, turn(2), prompt) < hit < prompt


def test_image_and_text_requests_decode_in_one_batch_each_as_alone(server, tokenizer):
    import concurrent.futures

    def conversation(i: int) -> list[dict]:
        if i == 2:
            return [{"role": "user", "content": "Only text here, no screenshot at all."}]
        shot = [{"type": "text", "text": f"Screenshot {i}:"}, image_block(10 + i)]
        return [{"role": "user", "content": shot}]

    chats = [Chat(server, tokenizer, MODEL) for _ in range(3)]
    alone = [c.ask(conversation(i), True, 160)[0] for i, c in enumerate(chats)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(c.ask, conversation(i), False, 160) for i, c in enumerate(chats)]
        together = [f.result()[0] for f in futures]
    assert together == alone
    stats = httpx.get(server.url + "/v1/cache/stats").json()["scheduler"]
    assert stats["largest_batch"] >= 2, stats


def test_a_restarted_server_resumes_past_the_image_from_an_ssd_checkpoint(
    hybrid_root, tokenizer, tmp_path
):
    chat, turn1, prompt1, hit = turn_two_after_a_restart(hybrid_root, tokenizer, tmp_path, MODEL)
    assert hit > image_end(chat, turn1, prompt1)
