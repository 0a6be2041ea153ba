"""How much one sequence drafts: the draft length follows its running acceptance.

A fully accepted draft doubles the next one (up to the bound); a partly accepted one shrinks
it to what was accepted plus one. A draft rejected at its first token makes the sequence
stop drafting for 1, 2, 4, ... up to `MAX_PAUSE` steps, so a drafter that is always wrong
costs about one verify pass in `MAX_PAUSE` steps, and one that proposes nothing costs a
lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...engine_settings import Mode, SpeculativeSettings
from .drafters import Drafter, PromptLookup

if TYPE_CHECKING:
    from ...models.loading import LoadedModel

MAX_PAUSE = 64


def new_drafter(
    settings: SpeculativeSettings, prompt: Sequence[int], model: LoadedModel | None = None
) -> Drafter | None:
    """A drafter for one sequence of `model`: its MTP head where it has one and the mode
    asks for it ("mtp", or "auto" where drafting pays), else prompt lookup where asked;
    None: decode plainly ("off", or "mtp" on a model without a head)."""
    if settings.drafter is not None:
        return settings.drafter(prompt)
    from . import mtp  # mlx: only once a sequence drafts

    mode = settings.mode
    auto = mode == Mode.AUTO
    if (mode == Mode.MTP or (auto and auto_mtp())) and model is not None and model.mtp is not None:
        drafter = mtp.drafter(model.mtp, model.model, settings.mtp_depth)
        if drafter is not None:
            return drafter
    if mode == Mode.PROMPT_LOOKUP or auto:
        return PromptLookup(prompt, settings.min_ngram, max(settings.min_ngram, 5))
    return None


def auto_mtp() -> bool:
    """Whether "auto" drafts with a model's MTP head: on a GPU (Metal), where a pass of two
    tokens costs about what one does. On the CPU a pass costs about linearly in its tokens
    and priming the head along the prompt doubled the demo's prefill, so "auto" takes
    prompt lookup there, which measured 1.3-2.0x plain decode on a copied edit on mlx[cpu]'s
    bundled reference BLAS, 2.2-3.2x with OpenBLAS preloaded (ops/blas.py), and within the
    machine's noise of it when every draft is wrong (bench `speculative`)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


class Speculation:
    """One sequence's drafter and draft length."""

    def __init__(self, drafter: Drafter, settings: SpeculativeSettings):
        self.drafter = drafter
        self.min_draft, self.max_draft = settings.min_draft, settings.max_draft
        self.k = min(settings.max_draft, max(settings.min_draft, 4))
        self._pause = 0
        self._misses = 0

    def draft(self, out: Sequence[int], room: int) -> list[int]:
        """The tokens to verify after the sequence's next input; [] to decode plainly."""
        if self._pause:
            self._pause -= 1
            return []
        k = min(self.k, room)
        if k <= 0:
            return []
        return list(self.drafter.propose(out, k))[:k]

    def update(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.k = min(self.max_draft, self.k * 2)
        else:
            self.k = max(self.min_draft, accepted + 1)
        if accepted == 0:
            self._misses += 1
            self._pause = min(MAX_PAUSE, 1 << (self._misses - 1))
        else:
            self._misses = 0
