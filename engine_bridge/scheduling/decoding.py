"""The decode half of a model's `Runner` (runner.py): one token per running sequence as one
batched forward pass, or, for a lone sequence with a drafter, a verify pass over its drafts.

The next step is launched as soon as this one's tokens are known (`mx.async_eval`), so the
model computes while the scheduler thread hands out events, admits and prefills; anything
that changes the batch first `_settle`s the step in flight.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import mlx.core as mx

from ..logctx import request_id
from .sampling import sample_rows
from .speculation.verify import verify

if TYPE_CHECKING:
    from .. import kv
    from ..models.loading import LoadedModel
    from .scheduler import Scheduler
    from .sequence import Seq


class Decoding:
    """Decode steps over `running` (row i of `batch`); the runner admits and retires."""

    loaded: LoadedModel
    scheduler: Scheduler
    batch: kv.Batch
    running: list[Seq]
    _inflight: mx.array | None

    def _retire(self, rows: list[int]) -> None:
        raise NotImplementedError

    def _fail_running(self, error: BaseException) -> None:
        raise NotImplementedError

    def _decode(self) -> bool:
        """Take one decode step's tokens, and leave the next step computing.

        The next step is launched as soon as this one's tokens are known (`mx.async_eval`),
        so the model computes while this thread hands out events, admits and prefills.
        Anything that changes the batch first `_settle`s the step in flight.
        """
        if not self.running:
            return False
        if len(self.running) == 1 and self.running[0].spec is not None:
            return self._decode_speculating(self.running[0])
        if len(self.running) > 1 and any(s.spec is not None for s in self.running):
            # Rows would accept different lengths: one token each this step instead.
            self.scheduler.stats.spec_paused_steps += 1
        if self._inflight is None:
            self._launch()
        self._collect()
        if self.running:
            self._launch()
        return True

    def _decode_speculating(self, seq: Seq) -> bool:
        """The lone running sequence: verify a draft when its drafter has one, else decode
        one token, leaving that step in flight as `_decode` does."""
        if self._inflight is not None:
            self._collect()
            if not self.running:
                return True
        # The first token is the client's time to first token: it comes from a plain step,
        # never from a verify pass, which costs more than one (a pass's tokens each run
        # their own experts: the warm tool round of a split demo-qwen36 waited 0.25 s).
        drafts = seq.spec.draft(seq.out, seq.job.max_tokens - len(seq.out) - 1) if seq.out else []
        if drafts:
            self._verify(seq, drafts)
        else:
            self._launch()
        return True

    def _verify(self, seq: Seq, drafts: list[int]) -> None:
        """Check the drafts in one pass (speculation/verify.py) and count the round."""
        stats = self.scheduler.stats
        t0 = time.perf_counter()
        try:
            out = verify(self.loaded.model, self.batch.cache, seq, drafts)
        except BaseException as e:
            self._fail_running(e)
            return
        seq.spec.update(len(drafts), out.accepted)
        stats.decode_s += time.perf_counter() - t0
        stats.count_step(rows=1, tokens=out.committed)
        stats.spec_rounds += 1
        stats.spec_drafted += len(drafts)
        stats.spec_accepted += out.accepted
        stats.spec_replays += out.replayed
        if out.finished:
            self._retire([0])
        elif out.replay:
            self._launch(out.replay)

    def _launch(self, replay: list[int] | None = None) -> None:
        """Start the next step: each row feeds its next input (the lone row after `replay`,
        what a verify pass committed and put back) and samples from the last position."""
        t0 = time.perf_counter()
        try:
            inputs = mx.array([[*(replay or ()), s.next_input] for s in self.running])
            # A lone sequence drafting with an MTP head feeds it this step's hidden state
            # and token; in a batched step its head falls out of step and starts over.
            lone = self.running[0] if len(self.running) == 1 else None
            head = lone.mtp if lone is not None else None
            if head is None:
                # A vision model's rows shift their positions by their prompt's image layout.
                extra = {} if self.loaded.vision is None else {"rope_deltas": self._rope_deltas()}
                logits = self.loaded.model(inputs, cache=self.batch.cache, **extra)[:, -1, :]
                for s in self.running:
                    if s.mtp is not None:
                        s.mtp.lose_step()
            else:
                logits, hidden = head.forward(inputs, self.batch.cache)
                logits = logits[:, -1, :]
            toks = sample_rows(
                logits, [s.sampler for s in self.running], [s.history for s in self.running]
            )
            if head is None:
                mx.async_eval(toks)
            else:
                head.feed(hidden, toks, at=lone.fed)
                mx.async_eval(toks, head.state)
        except BaseException as e:
            self._fail_running(e)
            return
        self._inflight = toks
        self.scheduler.stats.decode_s += time.perf_counter() - t0

    def _rope_deltas(self) -> list[int]:
        return [s.job.prompt.vision.rope_delta if s.job.prompt.vision else 0 for s in self.running]

    def _collect(self) -> None:
        """Wait for the step in flight, hand out its tokens, retire finished rows."""
        toks, self._inflight = self._inflight, None
        if toks is None:
            return
        stats = self.scheduler.stats
        t0 = time.perf_counter()
        try:
            values = toks.tolist()
        except BaseException as e:
            self._fail_running(e)
            return
        stats.decode_s += time.perf_counter() - t0
        stats.count_step(rows=len(self.running), tokens=len(self.running))
        finished = []
        for row, (seq, tok) in enumerate(zip(self.running, values, strict=True)):
            request_id.set(seq.job.request.request_id or "-")
            if seq.accept(tok):
                finished.append(row)
        if finished:
            self._retire(finished)

    def _settle(self) -> None:
        """Finish the step in flight before the batch changes (a join, a cancel)."""
        if self._inflight is not None:
            self._collect()
