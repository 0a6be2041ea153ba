"""The parts of speculative decoding that need no engine: the acceptance rule against exact
distributions, prompt lookup, the draft-length control, and going back to an accepted
prefix on every cache kind of the real demo models."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from engine_bridge import kv
from engine_bridge.kv.caches import _leaves
from engine_bridge.models import loading as models
from engine_bridge.scheduling.sampling import RowSampler
from engine_bridge.scheduling.speculation.acceptance import accept
from engine_bridge.scheduling.speculation.control import (
    MAX_PAUSE,
    Speculation,
    SpeculativeSettings,
    new_drafter,
)
from engine_bridge.scheduling.speculation.drafters import PromptLookup
from engine_bridge.types import Sampling
from tests.conftest import DEMO_IDS

# --- the acceptance rule ------------------------------------------------------------------

P = np.array([0.5, 0.25, 0.15, 0.1])
TRIALS = 20_000


def _histogram(draw) -> np.ndarray:
    counts = np.zeros(len(P))
    for tok in draw:
        counts[tok] += 1
    return counts / counts.sum()


def _close_to(freq: np.ndarray, p: np.ndarray) -> None:
    # Five standard errors of a binomial share at TRIALS draws: fails on a wrong rule
    # (the draft kept always, or the residual not renormalized), not on noise.
    tol = 5 * np.sqrt(p * (1 - p) / TRIALS) + 1e-9
    assert np.all(np.abs(freq - p) <= tol), (freq, p)


@pytest.mark.parametrize("draft", [0, 3])
def test_a_fixed_draft_leaves_the_model_distribution_exact(draft):
    logp = mx.log(mx.array(P, dtype=mx.float32))
    keys = mx.random.split(mx.random.key(7), TRIALS)
    out = [accept(logp, draft, key=keys[i]) for i in range(TRIALS)]
    _close_to(_histogram(t for t, _ in out), P)
    kept = sum(k for _, k in out) / TRIALS
    assert abs(kept - P[draft]) < 5 * math.sqrt(P[draft] * (1 - P[draft]) / TRIALS)


def test_a_sampled_draft_leaves_the_model_distribution_exact():
    q = np.array([0.1, 0.2, 0.3, 0.4])
    logp = mx.log(mx.array(P, dtype=mx.float32))
    logq = mx.log(mx.array(q, dtype=mx.float32))
    rng = np.random.default_rng(3)
    keys = mx.random.split(mx.random.key(11), TRIALS)
    drafts = rng.choice(len(q), size=TRIALS, p=q)
    out = [accept(logp, int(d), key=keys[i], logq=logq) for i, d in enumerate(drafts)]
    _close_to(_histogram(t for t, _ in out), P)
    # Expected acceptance is sum(min(p, q)).
    kept = sum(k for _, k in out) / TRIALS
    assert abs(kept - np.minimum(P, q).sum()) < 0.02


def test_the_row_sampler_keeps_its_filters_when_verifying():
    # top_k=2 leaves tokens 0 and 1: a draft of 2 is never kept, and nothing outside the two
    # comes out; the shares are those of the renormalized pair.
    sampler = RowSampler(Sampling(temperature=1.0, top_k=2, seed=5))
    logits = mx.log(mx.array(P, dtype=mx.float32))[None]
    toks = [sampler.pick(logits, [], 2) for _ in range(4000)]
    assert not any(kept for _, kept in toks)
    freq = _histogram(t for t, _ in toks)
    assert freq[2] == freq[3] == 0
    assert abs(freq[0] - 2 / 3) < 0.04


def test_greedy_verification_keeps_only_the_argmax():
    sampler = RowSampler(Sampling(temperature=0.0))
    logits = mx.array([[0.1, 2.0, 0.3]])
    assert sampler.pick(logits, [], 1) == (1, True)
    assert sampler.pick(logits, [], 2) == (1, False)
    assert sampler.pick(logits, [], None) == (1, False)


# --- prompt lookup and the draft length ------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    prompt = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3, 4, 7, 8]
    d = PromptLookup(prompt, min_ngram=3, max_ngram=4)
    # The prompt ends ...7, 8: no earlier 7, 8 -> nothing to propose.
    assert d.propose([], 4) == []
    # Output 1, 2, 3 ends like two earlier places; the latest (index 7..10) wins: 4, 7, 8.
    assert d.propose([1, 2, 3], 3) == [4, 7, 8]
    # With 4 appended the 4-gram 2, 3, 4 ... (1, 2, 3, 4) matches at its latest: 7, 8, 1.
    assert d.propose([1, 2, 3, 4], 3) == [7, 8, 1]


def test_prompt_lookup_never_matches_the_suffix_with_itself():
    d = PromptLookup([5, 6, 7], min_ngram=3, max_ngram=3)
    assert d.propose([], 2) == []
    assert d.propose([5, 6, 7], 2) == [5, 6]  # the prompt's 5, 6, 7 is an earlier place


def test_prompt_lookup_follows_the_place_it_copies_from_not_the_latest_match():
    # 13, 14, 15 occurs twice: in the span being copied (then 16, 17) and later (30, 31).
    prompt = [10, 11, 12, 13, 14, 15, 16, 17, 99, 20, 13, 14, 15, 30, 31, 98]
    d = PromptLookup(prompt, min_ngram=3, max_ngram=3)
    assert d.propose([10, 11, 12], 3) == [13, 14, 15]
    copied = [10, 11, 12, 13, 14, 15]
    assert PromptLookup(prompt, 3, 3).propose(copied, 2) == [30, 31]  # the latest match
    assert d.propose(copied, 2) == [16, 17]  # the place the copy came from, followed on
    # The output leaves that place (50 where 16 was): back to matching, here 20, 13, 14.
    assert d.propose([*copied, 50, 20, 13, 14], 2) == [15, 30]


def test_a_short_match_is_not_a_draft():
    d = PromptLookup([1, 2, 8, 9, 1, 2], min_ngram=3, max_ngram=5)
    assert d.propose([], 4) == []  # "1, 2" repeats, but two tokens are coincidence


class _Fixed:
    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, out, k):
        return self.tokens[:k]


def test_the_draft_length_follows_acceptance_and_misses_pause_drafting():
    spec = Speculation(_Fixed([1] * 16), SpeculativeSettings(min_draft=1, max_draft=8))
    assert len(spec.draft([], 100)) == 4
    spec.update(4, 4)
    assert len(spec.draft([], 100)) == 8  # all kept: doubled, to the bound
    spec.update(8, 2)
    assert len(spec.draft([], 100)) == 3  # partly kept: what was kept plus one
    assert len(spec.draft([], 2)) == 2  # never past max_tokens
    pauses = []
    for _ in range(9):
        spec.update(1, 0)
        steps = 0
        while not spec.draft([], 100):
            steps += 1
        pauses.append(steps)
    assert pauses == [1, 2, 4, 8, 16, 32, 64, MAX_PAUSE, MAX_PAUSE]


# --- going back to the accepted prefix, on every cache kind -------------------------------

K = 4


@pytest.fixture(scope="module")
def loaded(demo_root):
    return {m: models.load(models.resolve(m, demo_root, [])) for m in DEMO_IDS}


def _feed(model, cache, tokens) -> mx.array:
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits[0]


def _state(cache) -> list:
    """What each leaf holds that decides what comes next: paged K/V up to its offset, the
    recurrent and conv arrays, and a rotating window's offset."""
    out = []
    for _, c in _leaves(cache):
        if isinstance(c, ArraysCache):
            out.append(("arrays", [np.array(a) for a in c.cache if a is not None]))
        elif isinstance(c, RotatingKVCache | KVCache):
            out.append(("offset", c.offset))
    return out


def _assert_same(a, b) -> None:
    assert len(a) == len(b)
    for (kind, x), (_, y) in zip(a, b, strict=True):
        if kind == "offset":
            assert x == y
        else:
            for u, v in zip(x, y, strict=True):
                # Feeding a run of tokens at once sums the recurrence in another order than
                # one at a time: float32 agrees to about 1e-5 of the values' scale.
                np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(v).max()))


@pytest.mark.parametrize("model_id", DEMO_IDS)
@pytest.mark.parametrize("prompt_len", [40, 126, 300], ids=["short", "wraps-in-pass", "wrapped"])
def test_every_accept_length_goes_back_to_the_plain_state(loaded, model_id, prompt_len):
    """Verify [x, d1..dK] with the first `a` drafts right, keep a+1: the state and what the
    model says next match plain decode of the same tokens, whether what was put back is fed
    again alone or ahead of the next step's token. demo-swa's window is 128: the
    second case wraps inside the pass, the third has wrapped before it."""
    lm = loaded[model_id]
    model = lm.model
    prompt = [(i * 37 + 11) % 4000 + 10 for i in range(prompt_len)]
    ref = make_prompt_cache(model)
    _feed(model, ref, prompt[:-1])
    truth, states, nexts = [], [], []
    x = prompt[-1]
    for _ in range(K + 1):
        logits = _feed(model, ref, [x])
        x = int(mx.argmax(logits[-1]).item())
        truth.append(x)
        states.append(_state(ref))
        nexts.append(np.array(logits[-1]))
    for a, ride in [(a, ride) for a in range(K + 1) for ride in (False, True)]:
        cache = make_prompt_cache(model)
        _feed(model, cache, prompt[:-1])
        drafts = truth[:a] + [(t + 1) % 4000 for t in truth[a:K]]
        inputs = [prompt[-1], *drafts]
        rewind = kv.Rewind(cache)
        logits = _feed(model, cache, inputs)
        assert int(mx.argmax(logits[a]).item()) == truth[a]
        replay = inputs[: a + 1] if rewind.to(fed=len(inputs), keep=a + 1) else []
        if ride:
            if a == K:
                continue
            # The decode loop's way: the replay rides in the next step's pass, ahead of
            # the step's own token; state and next logits are plain decode's one step on.
            after = _feed(model, cache, [*replay, truth[a]])
            _assert_same(_state(cache), states[a + 1])
        else:
            if replay:
                _feed(model, cache, replay)
            _assert_same(_state(cache), states[a])
            # What comes next from the rewound state is what plain decode says next.
            after = _feed(model, cache, [truth[a]])
        if a < K:
            np.testing.assert_allclose(np.array(after[-1]), nexts[a + 1], atol=1e-3, rtol=1e-3)


def test_a_cache_without_a_way_back_decodes_plainly(loaded):
    from mlx_lm.models.cache import ChunkedKVCache

    for lm in loaded.values():
        assert kv.can_rewind(make_prompt_cache(lm.model))
    assert not kv.can_rewind([KVCache(), ChunkedKVCache(16)])


def test_auto_drafts_by_prompt_lookup_on_every_device():
    assert isinstance(new_drafter(SpeculativeSettings(), [1, 2, 3]), PromptLookup)
    assert isinstance(new_drafter(SpeculativeSettings(mode="prompt-lookup"), [1]), PromptLookup)
    assert new_drafter(SpeculativeSettings(mode="off"), [1]) is None
