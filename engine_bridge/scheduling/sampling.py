"""Per-request sampling inside a shared batch: each row keeps its own parameters and RNG.

A request with a seed draws from its own key stream, so its output does not depend on what
else shares its batch or on how many steps ran before it was admitted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from ..types import Sampling
from .output_rules import OutputRule
from .speculation.acceptance import accept

# The repetition penalty looks at this many recent tokens (mlx-lm's default context).
PENALTY_CONTEXT = 20


class RowSampler:
    """Turns one row of logits into a token, with this request's parameters."""

    def __init__(self, s: Sampling, rule: OutputRule | None = None):
        self.rule = rule
        self.temperature = s.temperature
        self.top_p, self.top_k, self.min_p = s.top_p, s.top_k, s.min_p
        self._key = mx.random.key(s.seed) if s.seed is not None else None
        self.processors = (
            make_logits_processors(
                repetition_penalty=s.repetition_penalty,
                repetition_context_size=PENALTY_CONTEXT,
            )
            if s.repetition_penalty and s.repetition_penalty != 1.0
            else []
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def process(self, history: Sequence[int], logits: mx.array) -> mx.array:
        """Apply logits processors (repetition penalty) and the output rule to a [1, V] row."""
        if self.processors:
            recent = mx.array(list(history[-PENALTY_CONTEXT:]))
            for p in self.processors:
                logits = p(recent, logits)
        if self.rule is not None:
            logits = self.rule.apply(logits)
        return logits

    def sample(self, logits: mx.array) -> mx.array:
        """A [1] token from [1, V] processed logits."""
        logprobs = _logprobs(logits)
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self._filtered(logprobs) * (1.0 / self.temperature),
                                     key=self._next_key())  # fmt: skip

    def pick(self, logits: mx.array, history: Sequence[int], draft: int | None) -> tuple[int, bool]:
        """One position of a speculative verify pass, from its [1, V] raw logits: the token
        this row takes there, and whether that is `draft` (speculation/acceptance.py)."""
        row = self.process(history, logits)
        logprobs = _logprobs(row)
        if self.greedy:
            tok = int(mx.argmax(logprobs, axis=-1).item())
            return tok, tok == draft
        scaled = self._filtered(logprobs) * (1.0 / self.temperature)
        logp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        if draft is None:
            return int(mx.random.categorical(logp, key=self._next_key()).item()), False
        return accept(logp, draft, key=self._next_key())

    def greedy_picks(self, logits: mx.array) -> Callable[[int], int] | None:
        """For a greedy row without penalties, the token `pick` takes at each position of a
        verify pass's [N, V] raw logits, from one evaluation instead of one per position:
        the argmax, or under an output rule its forced token, else the argmax without its
        banned ones. Call it for positions 0, 1, ... in order, each after the token before
        it was accepted (the rule reads the output so far). None: use `pick`."""
        if not self.greedy or self.processors:
            return None
        rule = self.rule
        targets = greedy_tokens(logits if rule is None else rule.without_banned(logits))
        values = targets.tolist()
        if rule is None:
            return values.__getitem__

        def at(i: int) -> int:
            forced = rule.next_forced()
            return values[i] if forced is None else forced

        return at

    def _filtered(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p)
        # Keeping the top k of V <= k tokens keeps them all; mlx-lm refuses such a k.
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def _next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key


def sample_rows(
    logits: mx.array, samplers: Sequence[RowSampler], histories: Sequence[Sequence[int]]
) -> mx.array:
    """One token per row of [B, V] logits; a single argmax when every row is plain greedy."""
    if all(s.greedy and not s.processors and s.rule is None for s in samplers):
        return mx.argmax(_logprobs(logits), axis=-1)
    rows = []
    for i, (s, history) in enumerate(zip(samplers, histories, strict=True)):
        row = s.process(history, logits[i : i + 1])
        rows.append(s.sample(row))
    return mx.concatenate(rows)


def greedy_tokens(logits: mx.array) -> mx.array:
    """The greedy token of each row of [N, V] logits, exactly as plain decode picks it."""
    return mx.argmax(_logprobs(logits), axis=-1)


def _logprobs(logits: mx.array) -> mx.array:
    # Greedy takes the argmax of these too, not of the raw logits: normalizing rounds two
    # nearly tied logits alike, and mlx-lm picks from the normalized ones. Same input, same
    # token as mlx-lm and as this proxy before batching.
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
