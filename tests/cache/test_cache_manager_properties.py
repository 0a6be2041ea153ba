"""CacheManager properties over random conversation trees (hypothesis): every match equals a
brute-force oracle's longest restorable prefix, and the budget, pin and free-queue invariants
hold under random traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.ram.checkpoints import Checkpoint
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.ram.matching import Match
from engine_bridge.cache.ram.pool import Block
from tests.cache.test_cache_manager import BS, FakePayload, cache, chain, checkpoint, restored


@dataclass(frozen=True)
class Stored:
    tenant: str
    tokens: tuple[int, ...]
    blocks: frozenset[int]
    checkpoints: tuple[int, ...]


def block_stored(stored, tenant, request, i, bs) -> bool:
    end = (i + 1) * bs
    return any(
        s.tenant == tenant and i in s.blocks and s.tokens[:end] == request[:end] for s in stored
    )


def brute_paged(stored, tenant, request, bs) -> int:
    """Deepest p < len(request): full blocks before p stored, and p reached by a stored unit."""
    best = 0
    for p in range(len(request)):
        j = p // bs
        if not all(block_stored(stored, tenant, request, i, bs) for i in range(j)):
            break
        if p % bs == 0 or any(
            s.tenant == tenant
            and s.tokens[:p] == request[:p]
            and (j in s.blocks or any(q // bs == j and q >= p for q in s.checkpoints))
            for s in stored
        ):
            best = p
    return best


def brute_checkpoint(stored, tenant, request, bs) -> int:
    """Deepest checkpoint position q < len(request) on the request's path, blocks before q stored."""
    return max(
        (
            q
            for s in stored
            if s.tenant == tenant
            for q in s.checkpoints
            if q < len(request)
            and s.tokens[:q] == request[:q]
            and all(block_stored(stored, tenant, request, i, bs) for i in range(q // bs))
        ),
        default=0,
    )


@st.composite
def branch_of(draw, seqs, token):
    """A sequence that shares a random prefix with an earlier one, or a fresh one."""
    prefix = ()
    if seqs and draw(st.integers(0, 3)):
        base = draw(st.sampled_from(seqs))
        prefix = base[: draw(st.integers(0, len(base)))]
    return prefix + tuple(draw(st.lists(token, max_size=14)))


@st.composite
def conversation_trees(draw):
    bs = draw(st.sampled_from([1, 2, 3, 4]))
    token = st.integers(0, 2)
    stored: list[Stored] = []
    for _ in range(draw(st.integers(1, 7))):
        seq = draw(branch_of([s.tokens for s in stored], token))
        n_full = len(seq) // bs
        # A runner stores every full block; a subset leaves holes (evictions, lost spills).
        blocks = frozenset(range(n_full))
        if n_full and draw(st.booleans()):
            blocks = draw(st.frozensets(st.integers(0, n_full - 1)))
        ckpts = draw(st.lists(st.integers(1, len(seq)), max_size=3, unique=True)) if seq else []
        stored.append(Stored(draw(st.sampled_from("ab")), seq, blocks, tuple(ckpts)))
    requests = [
        (draw(st.sampled_from("ab")), draw(branch_of([s.tokens for s in stored], token)))
        for _ in range(draw(st.integers(1, 5)))
    ]
    return bs, stored, requests


def extra_for(tenant: str):
    return (("model", "m"), ("tenant", tenant))


@settings(max_examples=300, deadline=None)
@given(conversation_trees())
def test_match_equals_brute_force_longest_restorable_prefix(tree):
    bs, stored, requests = tree
    m = CacheManager(10**9, block_size=bs)
    for s in stored:
        extra = extra_for(s.tenant)
        m.insert_blocks(Chain(s.tokens, bs, extra), {i: FakePayload(1) for i in s.blocks})
        for q in s.checkpoints:
            checkpoint(m, s.tokens[:q], extra, FakePayload(1), "boundary")
    for tenant, request in requests:
        extra = extra_for(tenant)
        paged = m.match(Chain(request, bs, extra), needs_checkpoint=False)
        assert paged.length == brute_paged(stored, tenant, request, bs)
        assert restored(paged) == list(request[: paged.length])
        snap = m.match(Chain(request, bs, extra), needs_checkpoint=True)
        assert snap.length == brute_checkpoint(stored, tenant, request, bs)
        assert restored(snap) == list(request[: snap.length])
        if snap.length:
            assert snap.checkpoint.position == snap.length
            assert snap.used_tokens == (bs if snap.blocks else 0)


def entries(m: CacheManager) -> list[Block | Checkpoint]:
    pool, ckpts = m._pool, m._checkpoints  # noqa: SLF001 - invariants span the internals
    return list(pool._by_key.values()) + list(ckpts._by_key.values())  # noqa: SLF001


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_budget_and_queue_invariants_hold_under_random_traffic(data):
    budget = data.draw(st.integers(0, 120))
    spilled = []
    m = cache(budget, on_evict=lambda entry: spilled.append(entry.payload))
    seqs: list[tuple[int, ...]] = []
    pinned: list[Match] = []
    inserted = set()
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["blocks", "checkpoint", "pin", "unpin", "reserve"]))
        seq = data.draw(branch_of(seqs, st.integers(0, 3)))
        seqs.append(seq)
        if op == "blocks" and len(seq) >= BS:
            payloads = {
                i: FakePayload(data.draw(st.integers(0, 30))) for i in range(len(seq) // BS)
            }
            m.insert_blocks(chain(seq), payloads)
            inserted.update(id(p) for p in payloads.values())
        elif op == "checkpoint" and seq:
            reason = data.draw(st.sampled_from(["periodic", "boundary"]))
            payload = FakePayload(data.draw(st.integers(0, 30)))
            checkpoint(m, seq, (), payload, reason)
            inserted.add(id(payload))
        elif op == "pin":
            match = m.match(chain(seq), needs_checkpoint=data.draw(st.booleans()))
            if m.acquire(match):
                pinned.append(match)
        elif op == "unpin" and pinned:
            m.release(pinned.pop(data.draw(st.integers(0, len(pinned) - 1))))
        elif op == "reserve":
            n = data.draw(st.integers(0, 60))
            if m.reserve(n):
                m.unreserve(n)

        stats = m.stats()
        live = entries(m)
        queued = list(m._lru)  # noqa: SLF001
        assert {id(e) for e in queued} == {id(e) for e in live if e.ref_cnt == 0}
        assert len(queued) == len(set(map(id, queued)))
        assert stats.bytes == sum(e.nbytes for e in live)
        assert stats.pinned_bytes == sum(e.nbytes for e in live if e.ref_cnt)
        assert stats.bytes <= budget or not queued, (stats, budget)
        held = {(id(b)) for match in pinned for b in match.blocks}
        assert held <= {id(e) for e in live}
        assert not {id(e.payload) for e in live} & {id(p) for p in spilled}
        assert {id(p) for p in spilled} <= inserted
