"""engine_bridge.kv on tiny random-weight mlx-lm models: restored caches resume exactly.

Every resume test compares three runs of the same suffix: the live cache that was extracted
(must match the restored one bit for bit: same state, same ops) and a cold single-call
prefill of the whole prompt (must match closely and in argmax; chunked prefill is not
guaranteed bit-identical on every backend).
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from engine_bridge.kv import (
    BlockPayload,
    CheckpointPayload,
    DenseKV,
    Kind,
    QuantKV,
    RotatingState,
    UnsupportedCacheError,
    extract_blocks,
    extract_checkpoint,
    layout,
    quantize_block,
    restore,
)
from engine_bridge.kv.payloads import arrays_of
from tests.support.kv_models import (
    BS,
    WINDOW,
    N,
    feed,
    models_fixture,  # noqa: F401 (the `models` fixture)
    quantized_cache,
    state_arrays,
    tokens_fixture,  # noqa: F401 (the `tokens` fixture)
)

# CPU measurements: 0 for most cases, 6.4e-6 of 4.7 (gemma3 token by token after the window
# wrapped: ring order changes the summation order), 1.1e-8 of 0.047 (falcon_h1 chunked scan).
RTOL = 1e-5


def _cold(model, toks: mx.array, cache: list | None = None) -> mx.array:
    return feed(model, make_prompt_cache(model) if cache is None else cache, toks)


def _leaves(cache: list) -> list:
    out = []
    for c in cache:
        out += _leaves(list(c.caches)) if isinstance(c, CacheList) else [c]
    return out


def _window(c: RotatingKVCache, x: mx.array) -> mx.array:
    """What the next token can attend to: `keep` sink tokens and the most recent ones."""
    x = c._temporal_order(x)
    n = min(c.offset, c.max_size)
    return mx.concatenate([x[..., : c.keep, :], x[..., x.shape[2] - (n - c.keep) :, :]], axis=2)


def _assert_same_state(live: list, restored: list) -> None:
    for a, b in zip(_leaves(live), _leaves(restored), strict=True):
        assert type(a) is type(b)
        if isinstance(a, ArraysCache):
            for x, y in zip(a.cache, b.cache, strict=True):
                assert np.array_equal(np.asarray(x), np.asarray(y))
        elif isinstance(a, RotatingKVCache):
            assert (a.offset, a.keep, a.max_size) == (b.offset, b.keep, b.max_size)
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert np.array_equal(np.asarray(_window(a, x)), np.asarray(_window(b, y)))
        else:
            assert a.offset == b.offset
            pairs = zip(state_arrays(a), state_arrays(b), strict=True)
            for x, y in pairs:
                assert np.array_equal(
                    np.asarray(x[..., : a.offset, :]), np.asarray(y[..., : b.offset, :])
                )


def _assert_matches_cold(logits: mx.array, cold: mx.array, rtol: float = RTOL) -> None:
    """Close relative to the logits' scale, and the same argmax wherever the cold top-2 margin
    is wider than the difference (ties and near-ties may legitimately flip)."""
    a, b = logits.astype(mx.float32), cold.astype(mx.float32)
    assert a.shape == b.shape
    diff = mx.abs(a - b).max().item()
    assert diff <= rtol * mx.abs(b).max().item(), f"max |restored - cold| = {diff}"
    top2 = mx.sort(b, axis=-1)[..., -2:]
    decided = top2[..., 1] - top2[..., 0] > 2 * diff
    assert mx.all(mx.where(decided, a.argmax(-1) == b.argmax(-1), True)).item()


def _resume(
    model,
    toks: mx.array,
    position: int,
    *,
    live_step: int | None = 13,
    suffix_step: int | None = None,
    make_cache=make_prompt_cache,
) -> tuple[list, list, CheckpointPayload]:
    """Prefill to `position`, checkpoint, restore; then assert state and suffix logits."""
    live = make_cache(model)
    feed(model, live, toks[:position], live_step)
    blocks = extract_blocks(live, 0, position // BS, BS)
    ckpt = extract_checkpoint(live, position, BS)
    restored = restore(model, blocks, position, ckpt, cache=make_cache(model))
    _assert_same_state(live, restored)

    suffix = toks[position:]
    from_live = feed(model, live, suffix, suffix_step)
    from_restored = feed(model, restored, suffix, suffix_step)
    assert mx.array_equal(from_restored, from_live).item()
    _assert_matches_cold(from_restored, _cold(model, toks, make_cache(model))[:, position:])
    return live, restored, ckpt


# --- layout ---------------------------------------------------------------------------------


def test_layout_marks_attention_paged_and_recurrent_or_windowed_state_snapshot(models):
    def kinds(name):
        lay = layout(make_prompt_cache(models[name]))
        return [(s.path, s.kind, s.cache_type) for s in lay.slots], lay.has_snapshots

    assert kinds("llama") == ([((0,), Kind.PAGED, "KVCache"), ((1,), Kind.PAGED, "KVCache")], False)
    assert kinds("hybrid") == (
        [((0,), Kind.SNAPSHOT, "ArraysCache"), ((1,), Kind.PAGED, "KVCache")],
        True,
    )
    assert kinds("swa") == (
        [((0,), Kind.SNAPSHOT, "RotatingKVCache"), ((1,), Kind.PAGED, "KVCache")],
        True,
    )
    assert kinds("cachelist") == (
        [
            ((0, 0), Kind.SNAPSHOT, "ArraysCache"),
            ((0, 1), Kind.PAGED, "KVCache"),
            ((1, 0), Kind.SNAPSHOT, "ArraysCache"),
            ((1, 1), Kind.PAGED, "KVCache"),
        ],
        True,
    )
    assert [s.cache_type for s in layout(quantized_cache(models["llama"])).paged] == [
        "QuantizedKVCache"
    ] * 2


def test_layout_refuses_cache_classes_it_cannot_store():
    with pytest.raises(UnsupportedCacheError, match="ChunkedKVCache"):
        layout([KVCache(), ChunkedKVCache(chunk_size=8)])


# --- resume ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [BS, 37, 4 * BS, N - 1])
def test_paged_resume_from_blocks_alone_matches_cold(models, tokens, length):
    model = models["llama"]
    live = make_prompt_cache(model)
    feed(model, live, tokens, 29)
    blocks = extract_blocks(live, 0, N // BS, BS)

    restored = restore(model, blocks, length, None)

    assert [c.offset for c in restored] == [length, length]
    for a, b in zip(live, restored, strict=True):
        assert mx.array_equal(a.keys[..., :length, :], b.keys).item()
        assert mx.array_equal(a.values[..., :length, :], b.values).item()
    suffix_logits = feed(model, restored, tokens[length:])
    _assert_matches_cold(suffix_logits, _cold(model, tokens)[:, length:])


@pytest.mark.parametrize("position", [2 * BS, 45])
@pytest.mark.parametrize("suffix_step", [None, 1])
def test_paged_resume_from_checkpoint_tail_matches_cold(models, tokens, position, suffix_step):
    _resume(models["llama"], tokens, position, suffix_step=suffix_step)


@pytest.mark.parametrize("length", [2 * BS, 40])
def test_paged_resume_inside_checkpoint_tail_matches_cold(models, tokens, length):
    # A request that diverges inside the partial block a checkpoint at 45 holds.
    model = models["llama"]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:45], 13)
    blocks = extract_blocks(live, 0, 2, BS)

    restored = restore(model, blocks, length, extract_checkpoint(live, 45, BS))

    assert [c.keys.shape[2] for c in restored] == [length, length]
    _assert_matches_cold(feed(model, restored, tokens[length:]), _cold(model, tokens)[:, length:])


def test_hybrid_checkpoint_restores_only_its_own_position(models, tokens):
    model = models["hybrid"]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:45], 13)
    ckpt = extract_checkpoint(live, 45, BS)
    with pytest.raises(AssertionError, match="checkpoint at 45, restoring 40"):
        restore(model, extract_blocks(live, 0, 2, BS), 40, ckpt)


@pytest.mark.parametrize("position", [2 * BS, 45, N - 1])
@pytest.mark.parametrize("suffix_step", [None, 1])
def test_hybrid_resume_from_checkpoint_matches_cold(models, tokens, position, suffix_step):
    _resume(models["hybrid"], tokens, position, suffix_step=suffix_step)


def test_hybrid_resume_after_decode_steps_matches_cold(models, tokens):
    # The live cache reached its position through single-token steps, as after generation.
    _resume(models["hybrid"], tokens, 40, live_step=1, suffix_step=7)


def test_hybrid_restore_without_checkpoint_is_refused(models, tokens):
    model = models["hybrid"]
    live = make_prompt_cache(model)
    feed(model, live, tokens[: 2 * BS])
    with pytest.raises(AssertionError, match="snapshot layers need a checkpoint"):
        restore(model, extract_blocks(live, 0, 2, BS), 2 * BS, None)


@pytest.mark.parametrize(
    ("position", "live_step"),
    [
        (20, 13),  # before the window wraps
        (WINDOW, None),  # exactly full
        (45, 13),  # wrapped by chunked prefill
        (N - 1, None),  # one long chunk: buffer holds the whole prompt
        (50, 1),  # wrapped by single-token steps (in-place ring buffer)
    ],
)
@pytest.mark.parametrize("suffix_step", [None, 1])
def test_sliding_window_resume_before_and_after_wrap_matches_cold(
    models, tokens, position, live_step, suffix_step
):
    _resume(models["swa"], tokens, position, live_step=live_step, suffix_step=suffix_step)


def test_sliding_window_checkpoint_holds_one_window_after_long_chunk(models, tokens):
    model = models["swa"]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:70])
    assert live[0].keys.shape[2] == 70  # the live buffer keeps the whole chunk

    ckpt = extract_checkpoint(live, 70, BS)

    (state,) = ckpt.snapshots
    assert isinstance(state, RotatingState)
    assert (state.keys.shape[2], state.idx, state.offset) == (WINDOW, WINDOW, 70)
    assert mx.array_equal(state.keys, live[0].keys[..., 70 - WINDOW :, :]).item()


@pytest.mark.parametrize("position", [2 * BS, 45])
def test_cachelist_resume_from_checkpoint_matches_cold(models, tokens, position):
    _resume(models["cachelist"], tokens, position, suffix_step=7)


@pytest.mark.parametrize("position", [2 * BS, 45])
def test_quantized_kv_resume_matches_cold(models, tokens, position):
    _, restored, ckpt = _resume(
        models["llama"], tokens, position, make_cache=quantized_cache, suffix_step=5
    )
    assert all(isinstance(p, QuantKV) and p.bits == 8 for p in ckpt.tail)


def test_quantized_blocks_restore_into_quantized_cache_unchanged(models, tokens):
    model = models["llama"]
    live = quantized_cache(model)
    feed(model, live, tokens[:48])
    blocks = extract_blocks(live, 0, 3, BS)
    assert [x.dtype for x in blocks[0].kv[0].keys] == [mx.uint32, mx.float32, mx.float32]

    restored = restore(model, blocks, 48, None, cache=quantized_cache(model))

    _assert_same_state(live, restored)


# --- independence from the live cache ------------------------------------------------------


def _bits(parts) -> list[np.ndarray]:
    return [np.array(a, copy=True) for a in arrays_of(list(parts))]


def _payload_bits(blocks: list[BlockPayload], ckpt: CheckpointPayload) -> list[np.ndarray]:
    return [*(x for b in blocks for x in _bits(b.kv)), *_bits(ckpt.tail), *_bits(ckpt.snapshots)]


@pytest.mark.parametrize("name", ["llama", "hybrid", "swa"])
def test_stored_payloads_unchanged_when_live_cache_is_rewritten(models, tokens, name):
    model = models[name]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:45], 13)
    blocks = extract_blocks(live, 0, 2, BS)
    ckpt = extract_checkpoint(live, 45, BS)
    before = _payload_bits(blocks, ckpt)

    # Overwrite the live buffers in place where the payloads were cut from: rewind the paged
    # layers (as a cache that diverged mid-block would) and write other tokens there.
    other = (tokens + 1) % 256
    if name == "llama":
        for c in live:
            c.trim(45 - 20)
        feed(model, live, other[20:40], 1)
    feed(model, live, other[:30], 1)

    after = _payload_bits(blocks, ckpt)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("name", ["hybrid", "swa"])
def test_generation_after_restore_leaves_checkpoint_intact(models, tokens, name):
    model = models[name]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:50], 1)
    blocks = extract_blocks(live, 0, 3, BS)
    ckpt = extract_checkpoint(live, 50, BS)
    before = _payload_bits(blocks, ckpt)

    first = feed(model, restore(model, blocks, 50, ckpt), tokens[50:], 1)
    assert all(
        np.array_equal(a, b) for a, b in zip(before, _payload_bits(blocks, ckpt), strict=True)
    )
    second = feed(model, restore(model, blocks, 50, ckpt), tokens[50:], 1)
    assert mx.array_equal(first, second).item()


def test_stored_block_does_not_pin_the_padded_live_buffer():
    gc.collect()
    baseline = mx.get_active_memory()
    live = KVCache()
    mx.random.seed(2)
    keys, values = (mx.random.normal((1, 4, 1000, 64)) for _ in range(2))
    mx.eval(live.update_and_fetch(keys, values))  # a 2 MB buffer, padded to 1024 tokens
    del keys, values

    (block,) = extract_blocks([live], 2, 3, BS)
    del live
    gc.collect()

    assert block.nbytes == 2 * 4 * BS * 64 * 4
    assert mx.get_active_memory() - baseline < block.nbytes + 64 * 1024


# --- sizes ----------------------------------------------------------------------------------


def test_nbytes_is_shape_times_dtype(models, tokens):
    model = models["swa"]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:45], 13)
    (block,) = extract_blocks(live, 0, 1, BS)
    ckpt = extract_checkpoint(live, 45, BS)

    # One paged layer, one KV head of dim 32, float32.
    assert block.nbytes == 2 * BS * 32 * 4
    assert ckpt.nbytes == 2 * (45 - 2 * BS) * 32 * 4 + 2 * WINDOW * 32 * 4
    lazy = DenseKV(mx.zeros((1, 1, BS, 32)) * 2, mx.ones((1, 1, BS, 32), mx.bfloat16))
    assert lazy.nbytes == BS * 32 * 4 + BS * 32 * 2


# --- optional storage quantization ----------------------------------------------------------


def test_quantized_storage_shrinks_blocks_and_restores_close(models, tokens):
    model = models["llama"]
    live = make_prompt_cache(model)
    feed(model, live, tokens[:64])
    blocks = extract_blocks(live, 0, 4, BS)

    small = [quantize_block(b, bits=8, group_size=32) for b in blocks]

    assert all(isinstance(p, QuantKV) for b in small for p in b.kv)
    # 8 bits per element plus a float32 scale and bias per 32 elements, against 32 bits.
    assert small[0].nbytes * 32 == blocks[0].nbytes * 10
    suffix_logits = feed(model, restore(model, small, 64, None), tokens[64:])
    _assert_matches_cold(suffix_logits, _cold(model, tokens)[:, 64:], rtol=0.05)
