"""The MTP drafter: runs a model's multi-token-prediction head (models/mtp_head.py) over
the committed sequence and proposes its greedy drafts.

The head attends over every position it was fed, so its cache is primed along the prompt
at prefill (each chunk's hidden states with the tokens one ahead); a head that starts
cold at the first generated token accepts 10-14 points less. Its cache holds committed
positions only: a verify pass feeds it the accepted ones, and drafts deeper than one
token are trimmed off again as soon as they are proposed. A sequence restored from the
prefix cache starts its head at the restore point: the head's K/V is not in the cache,
and RoPE scores depend only on distances, so a head whose positions start at 0 there sees
the same attention as one started at the real offset, over a shorter past.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from ...kv import KVCache
from ...models.mtp_head import MTPHead, MTPSource


def drafter(source: MTPSource, model: Any, depth: int = 1) -> MTPDrafter | None:
    """A drafter over `source`'s head for `model`; None when the model's head did not load."""
    head = source.head()
    return MTPDrafter(head, model, depth) if head is not None else None


def _text_model(model: Any) -> Any:
    return getattr(model, "language_model", model)


class MTPDrafter:
    """Drafts greedily from the head; the runner feeds it every committed position.

    `feed` gives it committed (hidden state, next token) pairs, which also computes its
    next draft lazily; `propose` hands that draft out, and chains the head on its own
    output for deeper drafts (`depth` > 1), trimming those positions off again.
    """

    def __init__(self, head: MTPHead, model: Any, depth: int = 1):
        assert depth >= 1, depth
        self.head, self.depth = head, depth
        lm = _text_model(model)
        self.backbone = lm.model
        self._embed = head.embed_tokens if "embed_tokens" in head else lm.model.embed_tokens
        self._logits = (
            lm.model.embed_tokens.as_linear if lm.args.tie_word_embeddings else lm.lm_head
        )
        self.cache: list[KVCache] = []
        # The sequence position the head's position 0 stands for; None: out of step with
        # the sequence (new, or it missed positions), so the next feed starts it afresh.
        self.start: int | None = None
        self._last: mx.array | None = None  # the head's output at its last position
        self._draft: mx.array | None = None  # greedy token from it, computed lazily

    @property
    def position(self) -> int | None:
        """The sequence position the next fed pair must be at: while in step, the main
        cache's offset."""
        return None if self.start is None else self.start + self.cache[0].offset

    def forward(self, inputs: mx.array, cache: Any) -> tuple[mx.array, mx.array]:
        """The main model's logits and final hidden states from one pass: mlx-lm's Qwen3.5
        backbone returns the normed hidden states, and its `__call__` is lm_head of them."""
        hidden = self.backbone(inputs, cache)
        return self._logits(hidden), hidden

    def feed(
        self, hidden: mx.array, tokens: Sequence[int] | mx.array, at: int, draft: bool = True
    ) -> None:
        """Add committed positions at..at+L-1: the main model's [1, L, h] hidden states
        there and the L tokens that follow each. `draft=False` (a prefill chunk before the
        last) skips the draft from the last one: the next feed would replace it unread,
        and it costs a row of the vocabulary-sized head."""
        if self.start is None:
            self.cache, self.start = self.head.make_cache(), at
        assert at == self.position, (at, self.position)
        ids = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens))
        assert ids.size == hidden.shape[1], (ids.size, hidden.shape)
        out = self.head(hidden, self._embed(ids.reshape(1, -1)), self.cache)
        self._last = out[:, -1:, :] if draft else None
        self._draft = mx.argmax(self._logits(self._last)[0, -1], axis=-1) if draft else None

    def lose_step(self) -> None:
        """The sequence moved without feeding the head (a batched step): start it over."""
        self.start, self.cache, self._last, self._draft = None, [], None, None

    @property
    def state(self) -> list[Any]:
        """What to evaluate with the step that fed it."""
        draft = [] if self._draft is None else [self._draft]
        return [*draft, *(c.state for c in self.cache)]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c.keys is not None)

    def propose(self, out: Sequence[int], k: int) -> list[int]:
        if self._draft is None or k <= 0:
            return []
        drafts = [int(self._draft.item())]
        deeper = min(k, self.depth) - 1
        if deeper > 0:
            h = self._last
            for _ in range(deeper):
                h = self.head(h, self._embed(mx.array([[drafts[-1]]])), self.cache)
                drafts.append(int(mx.argmax(self._logits(h)[0, -1]).item()))
            for c in self.cache:
                c.trim(deeper)
        return drafts
