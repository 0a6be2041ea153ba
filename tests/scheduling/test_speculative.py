"""Speculative decoding in the scheduler, on the real demo models: greedy output is the same
token for token as plain decode, whatever the drafter proposes, alone or in a batch, and
what the prefix cache stores while speculating is what plain prefill stores.

The drafters are scripted: an oracle that proposes plain decode's own continuation, one that
breaks it at seeded positions (every accept length 0..k), one that is always wrong, and the
real prompt lookup.
"""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.scheduling.forced_output import ENV
from engine_bridge.scheduling.runner import Runner
from engine_bridge.scheduling.speculation.control import Mode, SpeculativeSettings
from engine_bridge.types import GenerationRequest, GenerationResult, Message, Sampling
from tests.conftest import DEMO_IDS, QWEN36, fresh_cache_dir

K = 4
PROMPTS: dict[int, list[int]] = {}  # the prompt tokens of each request _generate ran
SYSTEM = "You are terse. Repeat the file back: " + "def add(a, b):\n    return a + b\n" * 12


class Oracle:
    """Proposes what plain decode wrote, from where the output stands."""

    def __init__(self, truth: list[int]):
        self.truth = truth

    def propose(self, out, k):
        return self.truth[len(out) : len(out) + k]


class Corrupted(Oracle):
    """The oracle's draft with one token wrong at a seeded place (or none): every accept
    length from 0 to k comes up."""

    def __init__(self, truth: list[int], seed: int):
        super().__init__(truth)
        self.rng = random.Random(seed)
        self.breaks: set[int] = set()

    def propose(self, out, k):
        draft = super().propose(out, k)
        at = self.rng.randint(0, k)
        if at < len(draft):
            draft[at] = (draft[at] + 1) % 4000
        self.breaks.add(min(at, len(draft)))
        return draft


class Wrong:
    def propose(self, out, k):
        return [3] * k


def _request(model: str, i: int = 0, speculative: bool = True, n: int = 96, **kw):
    return GenerationRequest(
        model=model,
        messages=[Message("system", SYSTEM), Message("user", f"question {i}")],
        max_tokens=n,
        sampling=Sampling(temperature=0.0),
        speculative=speculative,
        **kw,
    )


async def _generate(engine: Engine, req: GenerationRequest) -> tuple[list[int], GenerationResult]:
    """The request's output token ids (every one, not just those that made text)."""
    _, out, result = await _generate_seen(engine, req)
    return out, result


async def _generate_seen(
    engine: Engine, req: GenerationRequest
) -> tuple[list[int], list[int], GenerationResult]:
    """The request's prompt token ids, its output token ids, and its result."""
    outs: dict[int, list[int]] = {}
    _watch(await engine.models.runner(req.model), outs)
    stream = await engine.start(req)
    async for _ in stream:
        pass
    assert stream.result is not None
    prompt = PROMPTS.pop(id(req))
    TRUTH[tuple(prompt)] = out = outs.pop(id(req))
    return prompt, out, stream.result


# What each prompt's last run wrote: the batch test's oracle proposes it.
TRUTH: dict[tuple[int, ...], list[int]] = {}


def _watch(runner: Runner, outs: dict[int, list[int]]) -> None:
    if getattr(runner, "_watched", None) is outs:
        return
    done = runner._on_done

    def on_done(seq, result):
        outs[id(seq.job.request)] = list(seq.out)
        PROMPTS[id(seq.job.request)] = list(seq.tokens)
        if done is not None:
            done(seq, result)

    runner._on_done = on_done
    runner._watched = outs


def _build(demo_root, where, model_ids) -> Engine:
    return Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, where),
            model_specs=list(model_ids),
            ssd_enabled=False,
            # "auto" drafts only on a GPU; these tests run prompt lookup on the CPU too.
            speculation=SpeculativeSettings(mode=Mode.PROMPT_LOOKUP),
        )
    )


@pytest.fixture
def engine(demo_root, tmp_path):
    e = _build(demo_root, tmp_path / "cache", (*DEMO_IDS, QWEN36))
    yield e
    asyncio.run(e.close())


def _run(coro):
    return asyncio.run(coro)


# demo-qwen36: a verify pass through its experts, whatever the drafter; its batches run
# speculation through the MTP head (test_speculative_mtp.py), at a third of the cost here.
@pytest.mark.parametrize("model", [*DEMO_IDS, QWEN36])
def test_greedy_output_is_plain_decode_whatever_the_drafter(engine, model):
    spec = engine.scheduler.settings.speculation
    stats = engine.scheduler.stats

    async def scenario():
        plain, _ = await _generate(engine, _request(model, speculative=False, use_cache=False))
        seen = {}
        corrupted = Corrupted(plain, seed=5)
        spec.min_draft = spec.max_draft = K  # drafts of K, so every accept length 0..K fits
        for name, make in [
            ("oracle", lambda p: Oracle(plain)),
            ("corrupted", lambda p: corrupted),
            ("wrong", lambda p: Wrong()),
            ("prompt-lookup", None),
        ]:
            spec.drafter = make
            before = (stats.spec_drafted, stats.spec_accepted, stats.decode_steps)
            out, result = await _generate(engine, _request(model, use_cache=False))
            seen[name] = (out, result, before, (stats.spec_drafted, stats.spec_accepted,
                                                stats.decode_steps), corrupted.breaks)  # fmt: skip
        return plain, seen

    plain, seen = _run(scenario())
    assert len(plain) > 64  # crosses a 64-token block while speculating
    for name, (out, *_) in seen.items():
        assert out == plain, name
    # The oracle is accepted whole: far fewer model steps than tokens.
    _, _, before, after, _ = seen["oracle"]
    assert after[1] - before[1] >= (after[0] - before[0]) * 0.9
    assert after[2] - before[2] < len(plain) / 2
    # The corrupted oracle saw every accept length from 0 to K.
    assert set(range(K + 1)) <= seen["corrupted"][4]
    # The always-wrong drafter kept nothing, and backed off: few verify passes.
    _, _, before, after, _ = seen["wrong"]
    assert after[1] == before[1]
    # Paused 1, 2, 4, ... 32 steps after each miss: 7 verify passes in 96 tokens.
    assert after[0] - before[0] <= 7 * K


class Recording(Oracle):
    """The oracle, noting how many output tokens each proposal follows."""

    def __init__(self, truth: list[int]):
        super().__init__(truth)
        self.asked: list[int] = []

    def propose(self, out, k):
        self.asked.append(len(out))
        return super().propose(out, k)


def test_the_first_token_comes_from_a_plain_step_never_a_verify_pass(engine):
    """The first token is the client's time to first token, and a verify pass costs more
    than a plain step (each drafted token runs the model too: its experts, on a MoE). So
    the drafter is first asked once a token is out, even with a draft that would be kept
    whole; the output is still plain decode's."""
    spec = engine.scheduler.settings.speculation
    stats = engine.scheduler.stats

    async def scenario():
        plain, _ = await _generate(engine, _request("demo-llama", speculative=False,
                                                    use_cache=False, n=24))  # fmt: skip
        recording = Recording(plain)
        spec.drafter = lambda p: recording
        rounds = stats.spec_rounds
        out, _ = await _generate(engine, _request("demo-llama", use_cache=False, n=24))
        return plain, out, recording.asked, stats.spec_rounds - rounds

    plain, out, asked, rounds = _run(scenario())
    assert out == plain
    assert asked and min(asked) == 1, asked  # from the first token on, never before it
    assert rounds > 0  # and it did speculate after that


def test_a_batch_of_four_matches_plain_decode_row_for_row(engine):
    spec = engine.scheduler.settings.speculation
    # Each row's oracle proposes what its prompt's plain run wrote.
    spec.drafter = lambda prompt: Corrupted(TRUTH[tuple(prompt)], seed=len(prompt))

    async def scenario():
        outs = {}
        for model in DEMO_IDS:
            # Different lengths: the batch shrinks, and its last row decodes alone.
            plain = [await _generate(engine, _request(model, i, False, 30 + 30 * i,
                                                      use_cache=False))
                     for i in range(4)]  # fmt: skip
            together = await asyncio.gather(
                *(_generate(engine, _request(model, i, True, 30 + 30 * i, use_cache=False))
                  for i in range(4))
            )  # fmt: skip
            outs[model] = ([p[0] for p in plain], [t[0] for t in together])
        return outs

    outs = _run(scenario())
    for model, (plain, together) in outs.items():
        assert together == plain, model
    stats = engine.scheduler.stats
    assert stats.spec_paused_steps > 0  # several rows shared a step: no speculation there
    assert stats.spec_rounds > 0  # the last row left alone speculated


@pytest.mark.parametrize("model", DEMO_IDS)
def test_a_cache_hit_then_speculation_gives_what_plain_gives(demo_root, tmp_path, model):
    """The end-of-generation save while speculating holds the committed state only: the
    next turn restores it and answers as an engine that never speculated does."""

    async def two_turns(name: str, speculative: bool):
        engine = _build(demo_root, tmp_path / name, [model])
        # The plain engine runs first; this one's oracle proposes what it wrote.
        engine.scheduler.settings.speculation.drafter = lambda prompt: Corrupted(
            TRUTH[tuple(prompt)], seed=len(prompt)
        )
        try:
            first, r1 = await _generate(engine, _request(model, 7, speculative))
            follow = _request(model, 7, speculative)
            follow.messages = [*follow.messages, Message("assistant", r1.text),
                               Message("user", "and again")]  # fmt: skip
            second, r2 = await _generate(engine, follow)
            return first, second, r2, engine.scheduler.stats.spec_accepted
        finally:
            await engine.close()

    plain_first, plain_second, plain_hit, _ = _run(two_turns("plain", False))
    spec_first, spec_second, hit, accepted = _run(two_turns("spec", True))
    assert accepted > 0
    assert hit.cached_tokens == plain_hit.cached_tokens > 0
    assert (spec_first, spec_second) == (plain_first, plain_second)


@pytest.mark.parametrize("model", ["demo-llama", "demo-hybrid"])
def test_blocks_sealed_while_speculating_equal_plain_prefill(demo_root, tmp_path, model):
    async def scenario():
        spec = _build(demo_root, tmp_path / "spec", [model])
        plain = _build(demo_root, tmp_path / "plain", [model])
        try:
            # Plain decode (not stored) first: the oracle then proposes it, broken at
            # seeded places, so the stored blocks come from every kind of verify round.
            truth, _ = await _generate(plain, _request(model, 3, False, use_cache=False))
            spec.scheduler.settings.speculation.drafter = lambda p: Corrupted(truth, seed=9)
            prompt, out, _ = await _generate_seen(spec, _request(model, 3))
            assert out == truth
            # The same tokens, prefilled plainly and stored, generating nothing.
            warm = GenerationRequest(model=model, prompt_tokens=prompt + out[:-1],
                                     max_tokens=1, prefill_only=True)  # fmt: skip
            await _generate(plain, warm)
            return (
                {e.hash: e for e in spec.tiers.ram.entries() if hasattr(e, "hash")},
                {e.hash: e for e in plain.tiers.ram.entries() if hasattr(e, "hash")},
                len(prompt),
                spec.scheduler.stats.spec_accepted,
            )
        finally:
            await spec.close()
            await plain.close()

    spec_blocks, plain_blocks, prompt_len, accepted = _run(scenario())
    assert accepted > 0
    shared = spec_blocks.keys() & plain_blocks.keys()
    generated = [h for h in shared if spec_blocks[h].payload.payload.start + 64 > prompt_len]
    assert generated, "no block of generated tokens in common"
    for h in shared:
        a, b = spec_blocks[h].payload.payload, plain_blocks[h].payload.payload
        for x, y in zip(a.kv, b.kv, strict=True):
            for u, v in ((x.keys, y.keys), (x.values, y.values)):
                np.testing.assert_allclose(np.array(u), np.array(v), atol=1e-4, rtol=1e-3)


def test_prompt_lookup_drafts_a_copy_of_the_prompt_and_keeps_it(demo_root, tmp_path, monkeypatch):
    """The model is forced (through its logits, the real path) to write back a span of its
    prompt, as an edit does: prompt lookup drafts it and the model keeps the drafts."""
    copied = "def add(a, b):\n    return a + b\n" * 4
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps({"outputs": [{"match": "", "text": copied}]}))
    monkeypatch.setenv(ENV, str(forced))

    async def scenario():
        engine = _build(demo_root, tmp_path / "c", ["demo-llama"])
        try:
            _, plain = await _generate(engine, _request("demo-llama", speculative=False))
            stats = engine.scheduler.stats
            steps = stats.decode_steps
            _, spec = await _generate(engine, _request("demo-llama", 1))
            return plain, spec, stats.decode_steps - steps, stats.spec_accepted
        finally:
            await engine.close()

    plain, spec, steps, accepted = _run(scenario())
    assert plain.text == spec.text == copied
    assert accepted > spec.completion_tokens / 2
    assert steps < spec.completion_tokens / 2  # fewer model steps than tokens


@pytest.mark.parametrize("model", DEMO_IDS)
def test_an_output_rule_is_applied_at_each_verified_position_as_plain_decode_applies_it(
    engine, model, monkeypatch
):
    """Under an output rule (banned tokens, a forced opening, end of sequence after a call's
    end) a greedy verify pass reads all its positions from one evaluation; each position
    still takes the token plain decode takes there, the rule consulted in order."""
    import collections

    import engine_bridge.prepare as prepare_module
    from engine_bridge.scheduling.output_rules import OutputRule

    spec = engine.scheduler.settings.speculation
    rule: dict = {}
    # A fresh rule per request (a rule keeps its own state), built as `rule` says now.
    monkeypatch.setattr(prepare_module, "output_rule",
                        lambda *a, **kw: OutputRule(**rule) if rule else None)  # fmt: skip
    eos = 4089

    async def scenario():
        free, _ = await _generate(engine, _request(model, 4, False, use_cache=False))
        common = [t for t, _ in collections.Counter(free).most_common(3)]
        rule.update(eos=eos, banned=tuple(common), opening=free[10:13])
        opened, _ = await _generate(engine, _request(model, 4, False, use_cache=False))
        # End the output once it writes the pair it wrote at 40..41, as a call's end does.
        rule["stop_after"] = tuple(opened[40:42])
        plain, _ = await _generate(engine, _request(model, 4, False, use_cache=False))
        spec.min_draft = spec.max_draft = K
        outs = {}
        for name, make in [("oracle", lambda p: Oracle(plain)),
                           ("corrupted", lambda p: Corrupted(plain, seed=11)),
                           ("prompt-lookup", None)]:  # fmt: skip
            spec.drafter = make
            outs[name], _ = await _generate(engine, _request(model, 4, use_cache=False))
        return free, plain, outs, engine.scheduler.stats.spec_accepted

    free, plain, outs, accepted = _run(scenario())
    assert accepted > 0
    # The rule bit: it opened the answer, kept the banned tokens out, and ended it.
    assert plain[:3] == free[10:13] and plain != free
    assert not set(plain[3:]) & set(rule["banned"])  # the opening is forced whatever it holds
    assert plain[-1] == eos and tuple(plain[-3:-1]) == rule["stop_after"]
    for name, out in outs.items():
        assert out == plain, name
