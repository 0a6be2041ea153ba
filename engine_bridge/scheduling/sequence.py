"""One admitted request on the MLX thread: where its prefill stands, what it has decoded."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from ..types import CacheSource, FinishReason, GenerationResult, TokenEvent
from .jobs import CacheSession, Pending
from .sampling import RowSampler
from .speculation.control import Speculation
from .speculation.mtp import MTPDrafter

_admissions = itertools.count()
# A save point this close to the prompt's end starts its last chunk, which samples the
# first token (Qwen3.6's reasoning opener two tokens back, a generation prompt's start):
# one model pass fewer than a chunk to there, one to the last token and a decode step.
LAST_CHUNK_MAX = 8


# --- one request on the MLX thread ---------------------------------------------------------


class Seq:
    """An admitted request: its cache, where its prefill stands, what it has decoded."""

    def __init__(self, pending: Pending, session: CacheSession | None, tokenizer: Any):
        self.job = job = pending.job
        self.emit = pending.emit
        self.session = session
        self.start = pending.queued_at
        self.admitted = next(_admissions)
        self.cache: list[Any] = []
        self.position = 0
        self.cached = 0
        self.source: CacheSource = "none"
        self.stops: deque[int] = deque()
        # Where the last chunk starts when it samples the first token (plan_prefill): the
        # prompt's end for its save, the last token or a save point just before it.
        self.prompt_end: int | None = None
        self.out: list[int] = []
        if job.rule is not None:
            job.rule.out = self.out  # the rule reads the output as it grows
        self.sampler = RowSampler(job.request.sampling, job.rule)
        self.eos = set(tokenizer.eos_token_ids)
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stopper = StopMatcher(job.request.stop)
        self.unsent = 0  # tokens decoded since the last TokenEvent (their text not sent yet)
        self.history: list[int] = list(job.prompt.tokens[-64:])
        self.ttft: float | None = None
        self.restore_s = 0.0
        self.prefill_s = 0.0
        self.prefilled = 0  # prompt tokens this request computed (not restored)
        self.finish: FinishReason | None = None
        # Its drafter and draft length, when it speculates (decoding.py `_verify`).
        self.spec: Speculation | None = None
        # Its drafter when that is an MTP head, which the runner feeds every committed
        # position's hidden state (runner.py `_prefill`, decoding.py `_launch`, `_verify`).
        self.mtp: MTPDrafter | None = None

    def plan_prefill(self, chunk: int, points: Sequence[int], sample: bool) -> None:
        """Its chunk ends from where the cache left it (`prefill_plan`)."""
        stops, self.prompt_end = prefill_plan(self.position, len(self.tokens), chunk, points,
                                              sample)  # fmt: skip
        self.stops = deque(stops)

    @property
    def tokens(self) -> list[int]:
        return self.job.prompt.tokens

    @property
    def remaining(self) -> int:
        return self.stops[-1] - self.position if self.stops else 0

    @property
    def next_input(self) -> int:
        return self.out[-1] if self.out else self.tokens[-1]

    @property
    def fed(self) -> int:
        """Tokens in its cache once prefilled: all but `next_input`, the position the next
        step feeds."""
        return len(self.tokens) + len(self.out) - 1

    def accept(self, tok: int) -> bool:
        """Take a sampled token; True when the sequence is finished."""
        if self.ttft is None:
            self.ttft = time.perf_counter() - self.start
        self.out.append(tok)
        if tok in self.eos:
            self.finish = "stop"
            return True
        self.history.append(tok)
        self.detok.add_token(tok)
        self.unsent += 1
        text, hit = self.stopper.feed(self.detok.last_segment)
        if text:
            self.emit(TokenEvent(text, tok, self.unsent))
            self.unsent = 0
        if hit:
            self.finish = "stop_string"
        elif len(self.out) >= self.job.max_tokens:
            self.finish = "length"
        return self.finish is not None

    def flush_text(self) -> None:
        if self.finish != "stop_string":
            self.detok.finalize()
            tail, _ = self.stopper.feed(self.detok.last_segment, final=True)
            if tail:
                self.emit(TokenEvent(tail, self.out[-1] if self.out else -1, self.unsent))
                self.unsent = 0

    def result(self, used_cache: bool) -> GenerationResult:
        now = time.perf_counter()
        return GenerationResult(
            prompt_tokens=len(self.tokens),
            completion_tokens=len(self.out),
            cached_tokens=self.cached,
            source=self.source,
            finish_reason=self.finish or "cancelled",
            text=self.stopper.text,
            ttft_s=self.ttft if self.ttft is not None else now - self.start,
            generation_s=now - self.start,
            stop_string=self.stopper.matched,
            used_cache=used_cache,
            restore_s=self.restore_s,
            prefill_s=self.prefill_s,
            prefilled_tokens=self.prefilled,
        )


def prefill_plan(
    start: int, n: int, chunk: int, points: Sequence[int], sample: bool
) -> tuple[list[int], int | None]:
    """The chunk ends of an `n`-token prompt prefilled from `start`: multiples of `chunk`
    and the cache's save `points`, then the prompt's end; and where the prompt's end is
    saved, when the last chunk samples the first token.

    With `sample`, the last chunk runs to the very end and samples the first token from
    its last position, so no decode step of its own comes before the first token. It
    starts at the last save point within LAST_CHUNK_MAX of the end (or where the cache left
    it, if that is as close), saved as the prompt's end, else at the last token (a pass of
    one token, as a decode step is). Without, the prefill stops before the last token,
    whose logits the first decode step computes.
    """
    last = n - 1
    ends = set(range((start // chunk + 1) * chunk, last, chunk))
    ends.update(p for p in points if start < p < last)
    if not sample:
        return sorted(ends | ({last} if last > start else set())), None
    # The start counts: restored at a save point close to the end, one chunk runs from it.
    prompt_end = max((p for p in ends | {start} if p >= n - LAST_CHUNK_MAX), default=last)
    before = {p for p in ends if p < prompt_end}
    if prompt_end > start:
        before.add(prompt_end)
    return sorted(before | {n}), prompt_end


class StopMatcher:
    """Streams text while holding back anything that could be the start of a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.matched: str | None = None
        self._emitted = 0

    def feed(self, segment: str, final: bool = False) -> tuple[str, bool]:
        self.text += segment
        if self.stops:
            window_start = max(0, self._emitted - max(len(s) for s in self.stops))
            hits = [(i, s) for s in self.stops if (i := self.text.find(s, window_start)) != -1]
            if hits:
                cut, self.matched = min(hits)
                out = self.text[self._emitted : cut]
                self.text = self.text[:cut]
                self._emitted = cut
                return out, True
        hold = 0 if final else self._held_suffix()
        upto = len(self.text) - hold
        out = self.text[self._emitted : upto] if upto > self._emitted else ""
        self._emitted = max(self._emitted, upto)
        return out, False

    def _held_suffix(self) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    best = max(best, k)
                    break
        return best
