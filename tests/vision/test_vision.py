"""Images in the conversation (issue 13): the model path and the cache keys, on demo-vision
(Qwen2-VL, all attention) and demo-vision-hybrid (Qwen3.5: Gated DeltaNet and attention).

The model checks compare this proxy's chunked, cache-resumable forward pass with mlx-vlm's
own one-shot forward; the key checks prove a different image changes the keyed tokens
exactly from its first token, and the same picture re-encoded does not.
"""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from PIL import Image  # noqa: E402

from engine_bridge.types import EngineError, ImageInput  # noqa: E402
from engine_bridge.vision import model as vision  # noqa: E402
from engine_bridge.vision import prompt as vp  # noqa: E402


def picture(seed: int, width: int = 120, height: int = 90) -> Image.Image:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    return Image.fromarray(pixels)


def encoded(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **kw)
    return out.getvalue()


@pytest.fixture(scope="module", params=["demo-vision", "demo-vision-hybrid"])
def demo_vision(request, tmp_path_factory):
    from engine_bridge.models.demo import ensure_demo_model

    path = ensure_demo_model(request.param, tmp_path_factory.mktemp("vision-root"))
    model, config = vision.load(path)
    import mlx_lm.utils

    return model, config, mlx_lm.utils.load_tokenizer(path)


def vlm_cache(model):
    """mlx-vlm's own cache classes for its one-shot reference forward."""
    return model.lm.make_cache() if hasattr(model.lm, "make_cache") else make_prompt_cache(model)


def prepared(model, seed: int, **size) -> vp.PreparedImage:
    image = ImageInput(encoded(picture(seed, **size)), "image/png", f"img{seed}")
    return vp.preprocess(image, model.spec, vp.VisionLimits())


def two_image_prompt(demo_vision, seeds=(0, 1)):
    model, _, tok = demo_vision
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look at this"},
                {"type": "image"},
                {"type": "text", "text": "and compare it with this one"},
                {"type": "image"},
            ],
        }
    ]
    ids = tok.encode(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    images = [prepared(model, s, width=120 + 30 * i) for i, s in enumerate(seeds)]
    return ids, vp.expand(ids, [0], images, model.spec)


def test_rope_positions_equal_mlx_vlm_get_rope_index(demo_vision):
    model = demo_vision[0]
    _, (_, _, prompt) = two_image_prompt(demo_vision)
    grids = mx.array([list(i.grid_thw) for i in prompt.images])
    pos, delta = model.lm.get_rope_index(mx.array([prompt.model_tokens]), grids)
    assert np.array_equal(np.array(pos)[:, 0, :], prompt.positions)
    assert int(np.array(delta).reshape(-1)[0]) == prompt.rope_delta
    assert prompt.rope_delta < 0  # images take fewer positions than tokens


def test_chunked_prefill_and_decode_equal_mlx_vlm_forward(demo_vision):
    model = demo_vision[0]
    _, (keyed, _, prompt) = two_image_prompt(demo_vision)
    n = len(keyed)
    pixels = mx.array(np.concatenate([i.pixel_values for i in prompt.images]))
    grids = mx.array([list(i.grid_thw) for i in prompt.images])
    ref = model.vlm(
        mx.array([prompt.model_tokens]),
        pixel_values=pixels,
        image_grid_thw=grids,
        cache=vlm_cache(model),
    ).logits
    first, second = prompt.images
    # Chunk ends inside the first image, between the images, inside the second.
    cuts = [0, first.start + 3, second.start - 2, second.start + 5, n]
    cache = make_prompt_cache(model)
    for a, b in zip(cuts, cuts[1:], strict=False):
        out = model.prefill(prompt, a, b, cache)
    if model.hybrid:
        # Gated DeltaNet's scan resumed from a carried state rounds differently from one
        # pass (about 1e-5 here); one pass through the mlx-lm caches is exact, and the
        # decode step below runs on that cache.
        assert float(mx.abs(out[0, -1] - ref[0, -1]).max()) < 1e-4
        assert int(mx.argmax(out[0, -1])) == int(mx.argmax(ref[0, -1]))
        cache = make_prompt_cache(model)
        out = model.prefill(prompt, 0, n, cache)
        assert float(mx.abs(out - ref).max()) == 0.0
    assert float(mx.abs(out[0, -1] - ref[0, -1]).max()) == 0.0
    token = int(mx.argmax(ref[0, -1]))
    step = model(mx.array([[token]]), cache=cache, rope_deltas=[prompt.rope_delta])
    model.lm._rope_deltas = None
    ref_cache = vlm_cache(model)
    model.vlm(
        mx.array([prompt.model_tokens]),
        pixel_values=pixels,
        image_grid_thw=grids,
        cache=ref_cache,
    )
    ref_step = model.lm(mx.array([[token]]), cache=ref_cache).logits
    assert float(mx.abs(step - ref_step).max()) == 0.0
    # Both images were encoded once each: the chunks reused the feature cache.
    assert model.encoder_runs == 2


def test_greedy_decode_on_the_proxys_caches_equals_mlx_vlm_generation(demo_vision):
    """Prefill in 16-token chunks, then greedy decode, on the caches every tier pages and
    checkpoints (mlx-lm's classes; ArraysCache for the hybrid's Gated DeltaNet layers),
    gives the tokens mlx-vlm's own one-shot forward and decode give."""
    from engine_bridge import kv

    model = demo_vision[0]
    _, (keyed, _, prompt) = two_image_prompt(demo_vision, (3, 4))
    n, steps = len(keyed), 12
    cache = make_prompt_cache(model)
    kind = kv.layout(cache).cache_kind
    assert kind == (kv.CacheKind.HYBRID if model.hybrid else kv.CacheKind.PLAIN)
    for a in range(0, n, 16):
        logits = model.prefill(prompt, a, min(a + 16, n), cache)
    ours = [int(mx.argmax(logits[0, -1]))]
    for _ in range(steps - 1):
        logits = model(mx.array([ours[-1:]]), cache=cache, rope_deltas=[prompt.rope_delta])
        ours.append(int(mx.argmax(logits[0, -1])))

    model.lm._rope_deltas = None
    ref_cache = vlm_cache(model)
    logits = model.vlm(
        mx.array([prompt.model_tokens]),
        pixel_values=mx.array(np.concatenate([i.pixel_values for i in prompt.images])),
        image_grid_thw=mx.array([list(i.grid_thw) for i in prompt.images]),
        cache=ref_cache,
    ).logits
    ref = [int(mx.argmax(logits[0, -1]))]
    for _ in range(steps - 1):
        logits = model.lm(mx.array([ref[-1:]]), cache=ref_cache).logits
        ref.append(int(mx.argmax(logits[0, -1])))
    assert ours == ref
    assert len(set(ref)) > 1  # not one token repeated: the decode positions matter


def test_a_different_image_changes_keyed_tokens_from_its_first_token(demo_vision):
    ids, (keyed_a, starts, prompt_a) = two_image_prompt(demo_vision, (0, 1))
    _, (keyed_b, _, prompt_b) = two_image_prompt(demo_vision, (0, 2))
    first, second = prompt_a.images
    assert keyed_a[: second.start] == keyed_b[: second.start]
    changed = zip(
        keyed_a[second.start : second.end], keyed_b[second.start : second.end], strict=True
    )
    assert all(x != y for x, y in changed)
    assert keyed_a[second.end :] == keyed_b[second.end :]
    assert prompt_a.model_tokens == prompt_b.model_tokens  # the model sees the same pads
    assert all(t >= vp.KEY_BIT for t in keyed_a[first.start : first.end])
    assert max(ids) < vp.KEY_BIT
    assert len(keyed_a) == len(ids) - 2 + first.n_tokens + second.n_tokens
    assert starts == [0]


def test_the_same_picture_reencoded_has_the_same_digest(demo_vision):
    model = demo_vision[0]
    img = picture(7)
    spec, limits = model.spec, vp.VisionLimits()
    png_fast = vp.preprocess(ImageInput(encoded(img, compress_level=1), "", "a"), spec, limits)
    png_small = vp.preprocess(ImageInput(encoded(img, compress_level=9), "", "b"), spec, limits)
    bmp = vp.preprocess(ImageInput(encoded(img, "BMP"), "", "c"), spec, limits)
    assert png_fast.digest == png_small.digest == bmp.digest
    other = vp.preprocess(ImageInput(encoded(picture(8)), "", "d"), spec, limits)
    assert other.digest != png_fast.digest


def test_limits_and_undecodable_images_name_the_part(demo_vision):
    spec = demo_vision[0].spec
    where = "messages[2].content[1].source.data"
    data = encoded(picture(3, 200, 100))
    with pytest.raises(EngineError) as e:
        vp.preprocess(ImageInput(data, "", where), spec, vp.VisionLimits(max_image_bytes=100))
    assert (e.value.status, e.value.field) == (413, where)
    assert f"{len(data)} bytes, more than the 100 allowed" in e.value.message
    with pytest.raises(EngineError) as e:
        vp.preprocess(ImageInput(data, "", where), spec, vp.VisionLimits(max_image_pixels=19_999))
    assert (e.value.status, e.value.field) == (413, where)
    assert "200x100 pixels, more than the 19999 allowed" in e.value.message
    with pytest.raises(EngineError) as e:
        vp.preprocess(ImageInput(b"\x89PNG not really", "", where), spec, vp.VisionLimits())
    assert (e.value.status, e.value.field) == (400, where)
    assert e.value.message.startswith(f"{where}: not a decodable image")
    images = [ImageInput(data, "", f"messages[{i}].content[0].source.data") for i in range(3)]
    with pytest.raises(EngineError) as e:
        vp.check_count(images, vp.VisionLimits(max_images=2))
    assert e.value.field == "messages[2].content[0].source.data"
    assert "3 images, more than the 2 allowed" in e.value.message


def test_the_same_bytes_are_preprocessed_once_and_limits_still_apply(demo_vision):
    spec = demo_vision[0].spec
    data = encoded(picture(11, 300, 200))
    first = vp.preprocess(ImageInput(data, "", "a"), spec, vp.VisionLimits())
    hits = spec.prepared.hits
    first.start = 40  # what expand() does for one request ...
    again = vp.preprocess(ImageInput(data, "", "b"), spec, vp.VisionLimits())
    assert spec.prepared.hits == hits + 1
    assert (again.digest, again.grid_thw, again.start) == (first.digest, first.grid_thw, 0)
    with pytest.raises(EngineError) as e:  # ... a stricter limit is not skipped by the memo
        vp.preprocess(ImageInput(data, "", "c"), spec, vp.VisionLimits(max_image_pixels=59_999))
    assert e.value.message == (
        "c: the image is 300x200 pixels, more than the 59999 allowed ([vision] max_image_pixels)"
    )


def test_normalization_rules_rewrite_the_text_between_images():
    import re

    from engine_bridge.engine_settings import NormalizationRule
    from engine_bridge.prompting.render import normalize_messages
    from engine_bridge.types import Message

    image = ImageInput(b"png bytes", "image/png", "messages[0].content[1].source.data")
    rule = NormalizationRule("date", re.compile(r"\d{4}-\d{2}-\d{2}"), "<date>", ("user",))
    message = Message("user", "On 2026-12-01:", parts=("On 2026-12-01:", image, "see 2026-11-30"))
    (out,) = normalize_messages([message], [rule])
    assert out.parts == ("On <date>:", image, "see <date>")
    assert out.to_template()["content"] == [
        {"type": "text", "text": "On <date>:"},
        {"type": "image"},
        {"type": "text", "text": "see <date>"},
    ]


def test_models_listing_says_which_models_can_see(tmp_path, demo_vision):
    import json

    from engine_bridge.models.discovery import scan

    _, config, _ = demo_vision
    root = tmp_path / "lmstudio"
    for name, cfg in (
        ("org/vl", config),
        ("org/text", {"model_type": "llama"}),
        ("org/hybrid-vl", {"model_type": "qwen3_5", "vision_config": {"depth": 2}}),
        ("org/other-vl", {"model_type": "llava", "vision_config": {"depth": 2}}),
    ):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
    seen = {m.id: m.vision for m in scan([root])}
    assert seen == {
        "org/vl": "yes",
        "org/text": "no",
        "org/hybrid-vl": "yes",
        "org/other-vl": "unsupported",
    }
