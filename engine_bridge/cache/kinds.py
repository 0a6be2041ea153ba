"""The cache's vocabularies: what an entry is, why a checkpoint was saved, where a save runs.

String enums, so a value is also what goes into SQLite, a file's metadata and a folder name.
"""

from __future__ import annotations

from enum import StrEnum


class EntryKind(StrEnum):
    """A stored entry; the value names its folder and index rows on SSD."""

    BLOCK = "blocks"
    CHECKPOINT = "checkpoints"
    FEATURES = "features"  # a vision encoder's output for one image (vision/features.py)


class CheckpointReason(StrEnum):
    """Why a checkpoint exists; thinning drops only periodic ones (see checkpoints.py)."""

    PERIODIC = "periodic"
    BOUNDARY = "boundary"
    PROMPT_END = "prompt_end"
    GENERATION_END = "generation_end"


class PutReason(StrEnum):
    """Why an entry is written to SSD: counted apart in the SSD stats."""

    SPILL = "spill"  # the RAM tier evicted it
    WRITE_THROUGH = "write_through"  # written as it was stored (the write policy)


class SavePoint(StrEnum):
    """Where the runner hands computed state to the cache: the three save points."""

    PREFILL = "prefill"  # a prefill chunk ended
    PROMPT_END = "prompt_end"  # before the first generated token
    GENERATION_END = "generation_end"  # prompt plus output, also on a disconnect
