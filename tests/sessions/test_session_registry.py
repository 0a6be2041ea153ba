"""The session registry and its actions on the RAM tier, without a server: which entries a
session owns, pins that eviction respects within the cap, deletes that spare shared
entries, and the registry's round trip through its SQLite file."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine_bridge.cache.checkpoint_writes import DeferredWrites
from engine_bridge.cache.hashing import Chain
from engine_bridge.cache.kinds import CheckpointReason, EntryKind
from engine_bridge.cache.ram.manager import CacheManager
from engine_bridge.cache.session_registry import MAX_CHAINS, SessionKey, SessionRegistry
from engine_bridge.cache.session_store import SessionStore
from engine_bridge.cache.ssd.index import Scope
from engine_bridge.cache.ssd.offline import offline_clear
from engine_bridge.cache.tiers import TieredCache
from engine_bridge.sessions.catalog import ClientSessions
from engine_bridge.sessions.prune import GoneEntries
from engine_bridge.types import EngineError

BS = 4
EXTRA = (("model", "m"), ("tenant", "t"))
SCOPE = Scope("m", "t")
SYSTEM = list(range(100, 108))  # two blocks every session shares


@dataclass(slots=True)
class Payload:
    nbytes: int
    on_ssd: bool = False  # what the tiers' Stored payload carries


def key(name: str) -> SessionKey:
    return SessionKey("t", "demo", name)


def session_chain(own: int) -> Chain:
    """The shared two blocks, then two blocks of the session's own."""
    return Chain(SYSTEM + [own * 10 + i for i in range(8)], BS, EXTRA)


def stored(sessions: ClientSessions, name: str, own: int, nbytes: int = 100) -> Chain:
    """What a request of session `name` does: store its blocks, then tell the registry."""
    c = session_chain(own)
    sessions.tiers.ram.insert_blocks(c, {i: Payload(nbytes) for i in range(len(c.hashes))})
    sessions.note(key(name), SCOPE, BS, c.hashes)
    return c


@pytest.fixture
def sessions() -> ClientSessions:
    ram = CacheManager(10_000, block_size=BS)
    return ClientSessions(TieredCache(ram, None, codec=None), pin_max_bytes=450)


def test_a_session_owns_what_no_other_references_and_shares_the_rest(sessions):
    stored(sessions, "a", 1)
    stored(sessions, "b", 2)
    views = {v.id: v for v in sessions.views()}
    assert (views["a"].ram_bytes, views["a"].shared_bytes, views["a"].tokens) == (200, 200, 16)
    assert (views["b"].ram_bytes, views["b"].shared_bytes, views["b"].ssd_bytes) == (200, 200, 0)
    assert [v.id for v in sessions.views()] == ["b", "a"], "most recently used first"


def test_deleting_a_session_frees_its_own_blocks_and_keeps_the_shared_ones(sessions):
    a = stored(sessions, "a", 1)
    b = stored(sessions, "b", 2)
    freed, plan = sessions.drop_ram([key("a")])
    assert (freed.entries, freed.bytes) == (2, 200)
    assert plan.keys == {(SCOPE, EntryKind.BLOCK): a.hashes[2:]}
    ram = sessions.tiers.ram
    assert ram.has_blocks(a.hashes) == [True, True, False, False]
    assert ram.has_blocks(b.hashes) == [True, True, True, True]
    assert sessions.registry.get(key("a")) is None
    # Now B alone references the system prompt: it is B's own.
    (view,) = sessions.views()
    assert (view.id, view.ram_bytes, view.shared_bytes) == ("b", 400, 0)


def test_a_delete_leaves_entries_a_running_request_holds(sessions):
    a = stored(sessions, "a", 1)
    match = sessions.tiers.ram.match(a, needs_checkpoint=False, pin=True)
    assert match.length == 15
    freed, _ = sessions.drop_ram([key("a")])
    assert freed.entries == 0, "every block of A is in use"
    sessions.tiers.ram.release(match)


def test_pinned_entries_survive_eviction_within_the_cap(sessions):
    ram = sessions.tiers.ram
    a = stored(sessions, "a", 1)
    sessions.pin([key("a")])
    assert sessions.pinned_bytes() == 400 and ram.stats().pinned_bytes == 400
    stored(sessions, "b", 2)
    with pytest.raises(EngineError) as refused:
        sessions.pin([key("b")])  # 200 more (the shared part is held already): past 450
    assert refused.value.status == 409 and "pin_max" in refused.value.message
    ram.set_budget(400)  # a squeeze: everything unpinned goes
    assert ram.has_blocks(a.hashes) == [True] * 4
    assert ram.stats().bytes == 400 and ram.stats().evicted_blocks == 2
    # What a pinned session stores next is held too, while the cap allows.
    ram.set_budget(1000)
    c = Chain(a.tokens + (7, 7, 7, 7), BS, EXTRA)
    ram.insert_blocks(c, {4: Payload(40)})
    sessions.note(key("a"), SCOPE, BS, c.hashes)
    assert sessions.pinned_bytes() == 440
    sessions.unpin([key("a")])
    assert ram.stats().pinned_bytes == 0


def test_idle_sessions_are_those_unused_past_the_ttl_and_not_pinned(sessions):
    sessions.ttl_s = 60
    stored(sessions, "a", 1)
    stored(sessions, "b", 2)
    sessions.pin([key("b")])
    now = sessions.registry.get(key("a")).last_used
    assert sessions.idle(now + 30) == []
    assert sessions.idle(now + 61) == [key("a")]


def test_a_branch_replaces_the_chain_it_extends_and_new_branches_are_bounded():
    registry = SessionRegistry()
    base = session_chain(1).hashes
    registry.record(key("a"), SCOPE, BS, base[:2])
    registry.record(key("a"), SCOPE, BS, base)  # the next turn extends it
    rec = registry.get(key("a"))
    assert rec.chains == [base]
    for own in range(2, MAX_CHAINS + 3):  # edited histories: other paths
        registry.record(key("a"), SCOPE, BS, session_chain(own).hashes)
    assert len(rec.chains) == MAX_CHAINS
    assert rec.chains[-1] == session_chain(MAX_CHAINS + 2).hashes
    assert len(rec.blocks) == 2 + 2 * (MAX_CHAINS + 2), "every block stays owned"


def test_the_registry_round_trips_through_its_file(tmp_path):
    registry = SessionRegistry()
    c = session_chain(1)
    registry.record(key("a\x00../é"), SCOPE, BS, c.hashes, (c.checkpoint_key(15), 15))
    registry.record(key("b"), SCOPE, BS, session_chain(2).hashes)
    registry.set_pinned(key("b"), True)
    store = SessionStore(tmp_path)
    assert store.save(registry) == 2 and store.save(registry) == 0
    registry.remove([key("b")])
    assert store.save(registry) == 1
    store.close()
    loaded = SessionRegistry()
    assert SessionStore(tmp_path).load(loaded) == 1
    (rec,) = loaded.records()
    orig = registry.get(key("a\x00../é"))
    assert (rec.key, rec.scope, rec.chains, rec.blocks) == (
        orig.key,
        orig.scope,
        orig.chains,
        orig.blocks,
    )
    assert rec.positions == {c.checkpoint_key(15): 15} and not rec.pinned
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("sessions")) == []
    assert (tmp_path / "sessions.sqlite3").stat().st_mode & 0o777 == 0o600


def test_an_offline_clear_forgets_the_sessions_of_what_it_deleted(tmp_path):
    registry = SessionRegistry()
    registry.record(key("a"), Scope("model-a", "t"), BS, session_chain(1).hashes)
    registry.record(key("b"), Scope("model-b", "t"), BS, session_chain(2).hashes)
    store = SessionStore(tmp_path)
    store.save(registry)
    store.close()
    offline_clear(tmp_path, model="model-b")
    left = SessionRegistry()
    SessionStore(tmp_path).load(left)
    assert [r.key for r in left.records()] == [key("a")]
    offline_clear(tmp_path)
    assert SessionStore(tmp_path).load(SessionRegistry()) == 0


def test_a_deleted_sessions_checkpoint_waiting_to_be_written_is_never_written(sessions):
    ram = sessions.tiers.ram
    c = stored(sessions, "a", 1)
    ram.insert_checkpoint(c, 14, Payload(50), CheckpointReason.PROMPT_END)
    sessions.note(key("a"), SCOPE, BS, c.hashes, (c.checkpoint_key(14), 14))
    entry = ram.entry(EntryKind.CHECKPOINT, c.checkpoint_key(14))
    written = []
    deferred = DeferredWrites(delay_s=60)
    deferred.add(entry, lambda: written.append(entry) or True)
    freed, _ = sessions.drop_ram([key("a")])
    assert (freed.entries, freed.bytes) == (5, 450)
    assert deferred.flush(everything=True) == 0 and written == []


def test_entries_no_tier_holds_are_forgotten_after_two_looks(sessions):
    ram = sessions.tiers.ram
    a = stored(sessions, "a", 1)
    b = stored(sessions, "b", 2)
    gone = GoneEntries(sessions, min_gap_s=0)
    ram.set_budget(400)  # a squeeze: A's own two blocks are the least recently used
    assert ram.has_blocks(a.hashes) == [True, True, False, False]
    assert gone.look() == {}, "a first look only suspects"
    confirmed = gone.look()
    assert confirmed == {key("a"): [(EntryKind.BLOCK, h) for h in a.hashes[2:]]}
    assert gone.forget(confirmed) == 2
    rec = sessions.registry.get(key("a"))
    assert list(rec.blocks) == a.hashes[:2] and rec.chains == [a.hashes[:2]]
    assert list(sessions.registry.get(key("b")).blocks) == b.hashes
    assert key("a") in sessions.registry.dirty  # the store rewrites the smaller record
    # Deleting A now frees nothing of B's, as before.
    freed, _ = sessions.drop_ram([key("a")])
    assert freed.entries == 0 and ram.has_blocks(b.hashes) == [True] * 4


def test_an_entry_back_in_ram_by_the_second_look_or_the_forget_is_kept(sessions):
    ram = sessions.tiers.ram
    a = stored(sessions, "a", 1)
    stored(sessions, "b", 2)
    gone = GoneEntries(sessions, min_gap_s=0)
    ram.set_budget(400)
    gone.look()
    ram.set_budget(10_000)
    ram.insert_blocks(a, {2: Payload(100)})  # stored again between the looks
    confirmed = gone.look()
    assert confirmed == {key("a"): [(EntryKind.BLOCK, a.hashes[3])]}
    ram.insert_blocks(a, {3: Payload(100)})  # and again before the forget
    assert gone.forget(confirmed) == 0
    assert list(sessions.registry.get(key("a")).blocks) == a.hashes


def test_looks_closer_than_the_gap_are_skipped(sessions):
    stored(sessions, "a", 1)
    gone = GoneEntries(sessions, min_gap_s=3600)
    sessions.tiers.ram.set_budget(0)
    gone.look()
    assert gone.look() == {}
