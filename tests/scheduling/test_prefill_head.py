"""The vocabulary-sized head runs only where a logit is read, on demo-qwen36 (248,320 rows).

Two instruments, because MLX is lazy: a Python call to `lm_head` builds a graph node, and
only evaluation computes it.

- Call shapes. `lm_head` is wrapped in a module that records the rows (batch x length) of
  every call, and whether the runner was prefilling. Decode calls are evaluated (their
  tokens are sampled from them), so their rows are rows computed.
- Memory. A prefill chunk's plain forward does call `lm_head` on every position, and leaves
  the result unevaluated: the runner evaluates the caches' state only. No Python hook fires
  on evaluation, so each prefill step is measured instead: `mx.get_peak_memory()` above
  what was active when it began. The chunk's logits would need chunk x 248,320 x 4 bytes at
  once (64 MB for 64 tokens); a chunk that does not compute them peaks near 0.7 MB (1.5 MB
  for the last chunk of an MTP prefill: its draft's one row). The same instrument around a
  forward whose logits are evaluated shows them, so it would catch them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine_bridge.engine import Engine, EngineSettings
from engine_bridge.scheduling.speculation.control import Mode, SpeculativeSettings
from engine_bridge.types import GenerationRequest, Sampling
from tests.conftest import QWEN36, fresh_cache_dir
from tests.scheduling.test_speculative import Oracle, _generate

CHUNK = 64
PROMPT = 300  # five chunks of 64 and the rest, then the last token, which samples
OUT = 12


class CountingHead(nn.Module):
    """`lm_head` as it was, recording each call's rows and the phase it was called in."""

    def __init__(self, head: nn.Module, log: Phases):
        super().__init__()
        self.head = head
        self._log = log

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        (self._log.prefill_calls if self._log.prefilling else self._log.decode_calls).append(rows)
        return self.head(x)


@dataclass
class Phases:
    prefilling: bool = False
    prefill_calls: list[int] = field(default_factory=list)
    decode_calls: list[int] = field(default_factory=list)
    # Per prefill step that prefilled: (tokens, peak bytes above what was active before).
    prefill_peaks: list[tuple[int, int]] = field(default_factory=list)

    def clear(self) -> None:
        self.prefill_calls.clear()
        self.decode_calls.clear()
        self.prefill_peaks.clear()


def _logits_bytes(tokens: int, vocab: int) -> int:
    return tokens * vocab * 4  # demo-qwen36 is float32


@pytest.fixture(scope="module")
def instrumented(demo_root, tmp_path_factory):
    engine = Engine(
        EngineSettings(
            cache_dir=fresh_cache_dir(demo_root, tmp_path_factory.mktemp("prefill-head")),
            model_specs=[QWEN36],
            ssd_enabled=False,  # no writer thread allocating beside the measured steps
            prefill_chunk=CHUNK,
            speculation=SpeculativeSettings(mode=Mode.PROMPT_LOOKUP),
        )
    )
    log = Phases()

    async def setup():
        runner = await engine.models.runner(QWEN36)
        loaded = runner.loaded
        lm = loaded.model.language_model
        lm.lm_head = CountingHead(lm.lm_head, log)
        prefill, stats = runner._prefill, runner.scheduler.stats

        def measured_prefill(budget: int) -> bool:
            before = stats.prefill_tokens
            mx.reset_peak_memory()
            active = mx.get_active_memory()
            log.prefilling = True
            try:
                return prefill(budget)
            finally:
                log.prefilling = False
                if stats.prefill_tokens > before:
                    extra = max(0, mx.get_peak_memory() - active)
                    log.prefill_peaks.append((stats.prefill_tokens - before, extra))

        runner._prefill = measured_prefill
        return loaded

    loaded = asyncio.run(setup())
    yield engine, loaded, log
    asyncio.run(engine.close())


def _request(loaded, tenant: str, speculative: bool) -> GenerationRequest:
    text = "The proxy keeps each model's state across turns, sessions and restarts. " * 40
    tokens = loaded.tokenizer.encode(text)[:PROMPT]
    assert len(tokens) == PROMPT
    return GenerationRequest(model=QWEN36, prompt_tokens=tokens, max_tokens=OUT, tenant=tenant,
                             sampling=Sampling(temperature=0.0), speculative=speculative)  # fmt: skip


def _assert_prefill_computed_no_logits(log: Phases, vocab: int, sampled: bool = True) -> None:
    """No prefill step computes logits, but the last chunk where it samples the first token
    (runner.py): the last token alone here (no save point near the prompt's end), so one
    row, in the last step. An MTP prefill stops before the last token, which the first
    decode step feeds."""
    assert sum(n for n, _ in log.prefill_peaks) == PROMPT - (0 if sampled else 1)
    for i, (tokens, extra) in enumerate(log.prefill_peaks, 1):
        row = _logits_bytes(1, vocab) if sampled and i == len(log.prefill_peaks) else 0
        assert extra < row + _logits_bytes(tokens, vocab) / 8, (tokens, extra)


def test_the_instrument_sees_a_chunks_logits_when_they_are_evaluated(instrumented):
    _, loaded, log = instrumented
    ids = mx.array(list(range(1000, 1000 + CHUNK)))[None]
    peaks = {}
    for evaluated in (False, True):
        cache = make_prompt_cache(loaded.model)
        mx.reset_peak_memory()
        active = mx.get_active_memory()
        logits = loaded.model(ids, cache=cache)
        mx.eval([c.state for c in cache], logits if evaluated else [])
        peaks[evaluated] = mx.get_peak_memory() - active
        vocab = logits.shape[-1]
        del logits, cache
    log.clear()
    assert vocab == 248_320
    assert peaks[True] >= _logits_bytes(CHUNK, vocab) > 8 * peaks[False], peaks


def test_plain_decode_computes_one_row_per_token_and_prefill_none(instrumented):
    engine, loaded, log = instrumented
    log.clear()
    out, result = asyncio.run(_generate(engine, _request(loaded, "plain", speculative=False)))
    assert result.cached_tokens == 0 and len(out) == result.completion_tokens > 1
    _assert_prefill_computed_no_logits(log, loaded.model.language_model.args.vocab_size)
    # The last prefill chunk sampled the first token; each step after one row, read by the
    # sampler.
    assert log.decode_calls == [1] * (len(out) - 1)


def test_a_verify_pass_computes_the_rows_it_reads(instrumented):
    """With drafts always right nothing is put back: each pass's k+1 rows are each read
    (a token committed per row), so the rows computed are the tokens generated."""
    engine, loaded, log = instrumented
    truth, _ = asyncio.run(_generate(engine, _request(loaded, "truth", speculative=False)))
    spec = engine.scheduler.settings.speculation
    spec.drafter = lambda prompt: Oracle(truth)
    drafted = engine.scheduler.stats.spec_drafted
    log.clear()
    try:
        out, _ = asyncio.run(_generate(engine, _request(loaded, "oracle", speculative=True)))
    finally:
        spec.drafter = None
    assert out == truth
    assert engine.scheduler.stats.spec_drafted > drafted
    _assert_prefill_computed_no_logits(log, loaded.model.language_model.args.vocab_size)
    assert max(log.decode_calls) > 1  # verify passes
    assert sum(log.decode_calls) == len(out) - 1  # the first token is the prefill's


def test_an_mtp_prefill_scores_the_head_once_for_its_first_draft(instrumented):
    """Priming the MTP head along the prompt runs the backbone only; the one head row is
    the draft from the last chunk, which the first verify pass reads."""
    engine, loaded, log = instrumented
    spec = engine.scheduler.settings.speculation
    spec.mode = Mode.MTP
    log.clear()
    try:
        out, _ = asyncio.run(_generate(engine, _request(loaded, "mtp", speculative=True)))
    finally:
        spec.mode = Mode.PROMPT_LOOKUP
    assert len(out) > 1
    assert log.prefill_calls == [1]
    _assert_prefill_computed_no_logits(log, loaded.model.language_model.args.vocab_size,
                                       sampled=False)  # fmt: skip
