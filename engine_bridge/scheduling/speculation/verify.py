"""One verify pass: the model checks a sequence's next input and its drafts at once.

The pass feeds `[next input, d1..dk]`, keeps the longest prefix of drafts the model agrees
with plus the model's own token after it, and puts the caches back to exactly that state
(kv/rollback.py). Each position's token is chosen as plain decode would choose it: greedy
takes the argmax; sampling keeps a draft by the acceptance rule (acceptance.py); penalties
and output rules see the tokens accepted before that position. So the stream that stop
strings, max_tokens and the parsers see is what plain decode makes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from ... import kv
from ...logctx import request_id

if TYPE_CHECKING:
    from ..sequence import Seq


@dataclass(frozen=True, slots=True)
class Verified:
    committed: int  # tokens the sequence took: the accepted drafts and one of the model's
    accepted: int  # drafts kept
    finished: bool  # the sequence ended inside the pass (eos, stop string, max_tokens)
    replayed: bool  # a state was put back and the committed tokens fed again
    # Those tokens when they are yet to be fed (the next step feeds them before its own).
    replay: list[int]


def verify(model: Any, cache: list[Any], seq: Seq, drafts: list[int]) -> Verified:
    """Run the pass for the lone running `seq` over its `cache`, handing each committed
    token to `seq.accept`; the caches (and its MTP head, if any) end at the last one, or,
    where a state was put back and the sequence goes on without a head, before the
    `replay` tokens the next step must feed first."""
    inputs = [seq.next_input, *drafts]
    at = seq.fed  # where inputs[0] goes
    sampler = seq.sampler
    head = seq.mtp
    rewind = kv.Rewind(cache)
    if head is None:
        logits = model(mx.array(inputs)[None], cache=cache)[0]
    else:
        logits, hidden = head.forward(mx.array(inputs)[None], cache)
        logits = logits[0]
    picks = sampler.greedy_picks(logits)  # greedy: every position read at once
    if picks is None:
        mx.eval(logits)
    committed = accepted = 0
    finished = False
    for i in range(len(inputs)):
        draft = drafts[i] if i < len(drafts) else None
        if picks is not None:
            tok = picks(i)
            kept = tok == draft
        else:
            tok, kept = sampler.pick(logits[i : i + 1], seq.history, draft)
        committed += 1
        accepted += kept
        request_id.set(seq.job.request.request_id or "-")
        if seq.accept(tok):
            finished = True
            break
        if not kept:
            break
    replayed = rewind.to(fed=len(inputs), keep=committed)
    replay: list[int] = []
    if replayed and (finished or head is not None):
        model(mx.array(inputs[:committed])[None], cache=cache)
    elif replayed:
        # The state went back to before the pass: the next decode step feeds the committed
        # inputs ahead of its own, one pass instead of a replay and a step.
        replay = inputs[:committed]
    if head is not None and not finished:
        # The head learns the accepted positions only: each one's hidden state from this
        # pass (causal: what followed it does not change it) and its token.
        head.feed(hidden[:, :committed], seq.out[-committed:], at=at)
    mx.eval([c.state for c in cache], head.state if head is not None else [])
    return Verified(committed, accepted, finished, replayed, replay)
