"""When the SSD tier is written: `[cache.ssd] write_policy`, and the checkpoint write rules.

- `through`: a paged model's blocks are written when stored; checkpoints are written once
  they have stayed the deepest on their path for `checkpoint_delay_s` (or at close, or when
  RAM evicts them), so the many checkpoints a session supersedes turn after turn never
  reach the disk (see `tiers.TieredCache` and `supersede.py`).
- `evict`: only what RAM evicts is written (and nothing at close): the fewest writes, and a
  restart keeps only what had been evicted.
- `second-use`: an entry is written the first time a later request reuses it; RAM evicts
  never-reused entries without writing them (writing them too would add everything
  `evict` writes, for entries no request has come back to).

Whatever the policy, on a model with snapshot layers (hybrid):

- a checkpoint superseded by a deeper one on the same path, or a tip the conversation left
  (supersede.py), is never written;
- a generation-end checkpoint (state after the model's own output, which a client's next
  turn rarely sends back verbatim) is written only once a request reuses it, and a reused
  checkpoint that is not on disk waits `checkpoint_delay_s` like a new one (`through`);
- blocks are written with the checkpoints that need them, just before them and in order,
  not when stored: a block helps such a model only under a checkpoint at or after it on
  its path, so blocks of branches whose checkpoints are never written are never written
  (except what RAM evicts, spilled as ever, so a later checkpoint still finds them);
- a periodic checkpoint is written at once only where a crash would otherwise lose more
  than `SPARSE_PERIODIC_EVERY` intervals of the prefill that made it (tiers.py,
  `_periodic_due`).
"""

from __future__ import annotations

from enum import StrEnum


class WritePolicy(StrEnum):
    THROUGH = "through"
    EVICT = "evict"
    SECOND_USE = "second-use"


# Every k-th periodic checkpoint of a long prefill is written at once, whatever supersedes
# it: a crash or a kill mid-session then resumes from at most k intervals back.
SPARSE_PERIODIC_EVERY = 8


def resolve_write_policy(policy: str | None, write_through: bool | None) -> WritePolicy:
    """The policy from `write_policy` and its older alias `write_through` (true: through,
    false: evict); ValueError naming both when they disagree or the policy is unknown."""
    alias = (
        None
        if write_through is None
        else (WritePolicy.THROUGH if write_through else WritePolicy.EVICT)
    )
    if policy is None:
        return alias or WritePolicy.THROUGH
    try:
        chosen = WritePolicy(policy)
    except ValueError:
        known = ", ".join(repr(p.value) for p in WritePolicy)
        raise ValueError(f"write_policy {policy!r} is not one of {known}") from None
    if alias is not None and alias is not chosen:
        raise ValueError(
            f"write_policy = {policy!r} disagrees with write_through = "
            f"{str(write_through).lower()} (its alias for {alias.value!r}); drop write_through"
        )
    return chosen
