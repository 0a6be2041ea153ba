"""The speculative-sampling acceptance rule (Leviathan et al. 2023; Chen et al. 2023).

A draft token d proposed with probability q(d) is kept with probability min(1, p(d)/q(d)),
where p is the model's own distribution at that position. On a rejection the token is drawn
from the residual max(0, p - q), renormalized. Whatever q is, the token that comes out is
distributed exactly as p: speculation changes the speed, not the output distribution.

A deterministic drafter (prompt lookup, a greedy head) proposes d with q(d) = 1: d is kept
with probability p(d), and a rejection draws from p without d.
"""

from __future__ import annotations

import mlx.core as mx


def accept(
    logp: mx.array, draft: int, key: mx.array | None = None, logq: mx.array | None = None
) -> tuple[int, bool]:
    """The token at one position, and whether it is the draft.

    `logp` is the model's normalized log-distribution over the vocabulary ([V] or [1, V]),
    after every filter and the temperature; `logq` the drafter's (None: it always proposes
    `draft`); `key` the request's own random key (None: the global stream).
    """
    logp = logp.reshape(-1)
    k_accept, k_residual = mx.random.split(key) if key is not None else (None, None)
    if logq is None:
        ratio = mx.exp(logp[draft])
    else:
        logq = logq.reshape(-1)
        ratio = mx.minimum(mx.exp(logp[draft] - logq[draft]), 1.0)
    if mx.random.uniform(key=k_accept).item() < ratio.item():
        return draft, True
    if logq is None:
        residual = logp.at[draft].add(-mx.inf)  # p without d
    else:
        # log max(0, p - q); where p <= q the residual is empty.
        diff = mx.exp(logp) - mx.exp(logq)
        residual = mx.where(diff > 0, mx.log(mx.maximum(diff, 1e-38)), -mx.inf)
    return int(mx.random.categorical(residual, key=k_residual).item()), False
