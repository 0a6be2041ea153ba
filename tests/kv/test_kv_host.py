"""engine_bridge.kv host conversion: payloads to named host tensors and back, bit for bit.

What the SSD tier writes is `payload_to_host`'s output; `payload_from_host` must give back
exactly the payload it was made from, and refuse anything it did not write.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine_bridge.kv import (
    ArraysState,
    BlockPayload,
    DenseKV,
    PayloadFormatError,
    RotatingState,
    extract_blocks,
    extract_checkpoint,
    payload_from_host,
    payload_to_host,
    restore,
)
from tests.support.kv_models import (
    BS,
    feed,
    models_fixture,  # noqa: F401 (the `models` fixture)
    quantized_cache,
    tokens_fixture,  # noqa: F401 (the `tokens` fixture)
)


def _assert_bit_equal(a, b) -> None:
    """Payloads equal field by field, arrays by dtype, shape and raw bits."""
    assert type(a) is type(b)
    if isinstance(a, mx.array):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        carrier = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.itemsize]
        assert np.array_equal(np.asarray(a.view(carrier)), np.asarray(b.view(carrier)))
    elif isinstance(a, tuple | list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bit_equal(x, y)
    elif hasattr(a, "__slots__") and not isinstance(a, int | str):
        for field in a.__slots__:
            _assert_bit_equal(getattr(a, field), getattr(b, field))
    else:
        assert a == b


def _round_trip(payload):
    tensors, meta = payload_to_host(payload)
    assert sum(t.nbytes for t in tensors.values()) == payload.nbytes
    back = payload_from_host(tensors, meta)
    _assert_bit_equal(payload, back)
    return back, tensors


@pytest.mark.parametrize(
    ("name", "code"), [("llama", "F32"), ("llama-f16", "F16"), ("llama-bf16", "BF16")]
)
def test_host_round_trip_is_bit_exact_for_float_blocks_and_tails(models, tokens, name, code):
    model = models[name]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:45], 13)
    blocks = extract_blocks(live, 0, 2, BS)
    ckpt = extract_checkpoint(live, 45, BS)

    back = [_round_trip(p)[0] for p in (*blocks, ckpt)]

    assert {t.dtype for t in payload_to_host(blocks[0])[0].values()} == {code}
    suffix = tokens[45:50]
    original = feed(model, restore(model, blocks, 45, ckpt), suffix)
    restored = restore(model, back[:2], 45, back[2])
    assert mx.array_equal(feed(model, restored, suffix), original).item()


def test_host_round_trip_is_bit_exact_for_special_values():
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, 65504.0, 3.0e38]
    x = mx.array(specials).reshape(1, 1, 8, 1)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        kv = DenseKV(x.astype(dtype), -x.astype(dtype))
        _round_trip(BlockPayload(0, 8, (kv,)))


def test_host_round_trip_is_bit_exact_for_quantized_blocks(models, tokens):
    model = models["llama-bf16"]
    live = quantized_cache(model)
    feed(model, live, tokens[:45], 13)
    (block,) = extract_blocks(live, 1, 2, BS)

    _, tensors = _round_trip(block)
    _round_trip(extract_checkpoint(live, 45, BS))

    assert tensors["kv.0.keys.q"].dtype == "U32"
    assert tensors["kv.0.keys.scales"].dtype == "BF16"


@pytest.mark.parametrize("name", ["hybrid", "swa", "cachelist"])
def test_host_round_trip_restores_snapshot_checkpoints_exactly(models, tokens, name):
    model = models[name]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:45], 13)
    blocks = extract_blocks(live, 0, 2, BS)
    ckpt = extract_checkpoint(live, 45, BS)
    assert any(isinstance(s, ArraysState | RotatingState) for s in ckpt.snapshots)

    back, _ = _round_trip(ckpt)

    suffix = tokens[45:52]
    original = feed(model, restore(model, blocks, 45, ckpt), suffix, 1)
    restored = restore(model, blocks, 45, back)
    assert mx.array_equal(feed(model, restored, suffix, 1), original).item()


def test_payload_from_host_rejects_what_it_did_not_write(models, tokens):
    model = models["hybrid"]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:45], 13)
    tensors, meta = payload_to_host(extract_checkpoint(live, 45, BS))

    with pytest.raises(PayloadFormatError, match="snap.0.1"):
        payload_from_host({k: v for k, v in tensors.items() if k != "snap.0.1"}, meta)
    with pytest.raises(PayloadFormatError, match="format"):
        payload_from_host(tensors, {**meta, "format": "other/1"})
    with pytest.raises(PayloadFormatError, match="unexpected tensors"):
        payload_from_host({**tensors, "stray": tensors["kv.0.keys"]}, meta)
    with pytest.raises(PayloadFormatError, match="position"):
        payload_from_host(tensors, {**meta, "position": "forty"})
    with pytest.raises(PayloadFormatError, match="holds 13 tokens, expected 14"):
        payload_from_host(tensors, {**meta, "position": "46"})
