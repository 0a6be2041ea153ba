"""Content-addressed blocks with reference counts, and the O(1) LRU queue of evictable entries.

Payloads are opaque: the pool only reads the `nbytes` the caller computed. An entry is
evictable exactly when its reference count is zero, and then it sits in the free queue.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from engine_bridge.cache.hashing import BlockHash
from engine_bridge.cache.kinds import EntryKind


class Linked(Protocol):
    """What the free queue needs of an entry: its links, size and reference count."""

    prev_free: Any
    next_free: Any
    nbytes: int
    ref_cnt: int


@dataclass(slots=True, eq=False)
class Block:
    """One full block of tokens and its payload, stored once however many chains share it."""

    kind: ClassVar[EntryKind] = EntryKind.BLOCK
    block_id: int
    hash: BlockHash
    # The previous block's hash, or the chain root (seed + extra keys) for a first block.
    parent: BlockHash
    tokens: tuple[int, ...]
    payload: object = field(repr=False)
    nbytes: int
    ref_cnt: int = 0
    reads: int = 0  # lookups that restored it (halved each time eviction spares it)
    # Free-queue links: both None while the block is referenced.
    prev_free: Linked | None = field(default=None, repr=False)
    next_free: Linked | None = field(default=None, repr=False)

    @property
    def key(self) -> BlockHash:
        return self.hash

    def __repr__(self) -> str:
        return (
            f"Block(id={self.block_id}, hash={self.hash.hex()[:12]}, "
            f"tokens={len(self.tokens)}, nbytes={self.nbytes}, ref_cnt={self.ref_cnt})"
        )


@dataclass(slots=True, eq=False)
class _Sentinel:
    nbytes: int = 0
    ref_cnt: int = 0
    prev_free: Linked | None = None
    next_free: Linked | None = None


class FreeQueue:
    """Unreferenced entries, least recently used at the head.

    Intrusive doubly linked list with fake head and tail, so append, popleft and removal
    from the middle are O(1) and need no empty-list branches.
    """

    __slots__ = ("_head", "_tail", "_len", "nbytes")

    def __init__(self) -> None:
        self._head = _Sentinel()
        self._tail = _Sentinel()
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def append(self, node: Linked) -> None:
        """Make `node` the most recently used entry."""
        self._link(self._tail.prev_free, node)

    def appendleft(self, node: Linked) -> None:
        """Make `node` the next entry to evict."""
        self._link(self._head, node)

    def _link(self, prev: Linked, node: Linked) -> None:
        """Queue `node` right after `prev`."""
        assert node.prev_free is None and node.next_free is None, f"{node!r} is already queued"
        after = prev.next_free
        prev.next_free = node
        node.prev_free = prev
        node.next_free = after
        after.prev_free = node
        self._len += 1
        self.nbytes += node.nbytes

    def popleft(self) -> Any:
        """Remove and return the least recently used entry."""
        node = self._head.next_free
        assert node is not self._tail, "popleft from an empty free queue"
        self.remove(node)
        return node

    def peekleft(self) -> Any | None:
        node = self._head.next_free
        return None if node is self._tail else node

    def remove(self, node: Linked) -> None:
        prev, nxt = node.prev_free, node.next_free
        assert prev is not None and nxt is not None, f"{node!r} is not queued"
        prev.next_free = nxt
        nxt.prev_free = prev
        node.prev_free = node.next_free = None
        self._len -= 1
        self.nbytes -= node.nbytes


def pin(entry: Linked, queue: FreeQueue) -> None:
    """Reference `entry`; the first reference takes it out of the free queue."""
    if entry.ref_cnt == 0:
        queue.remove(entry)
    entry.ref_cnt += 1


def unpin(entry: Linked, queue: FreeQueue) -> None:
    """Drop a reference; the last one makes `entry` the most recently used evictable entry."""
    assert entry.ref_cnt > 0, f"release of unreferenced {entry!r}"
    entry.ref_cnt -= 1
    if entry.ref_cnt == 0:
        queue.append(entry)


def refresh(entry: Linked, queue: FreeQueue) -> None:
    """Mark an unreferenced entry most recently used; a referenced one is not evictable anyway."""
    if entry.ref_cnt == 0:
        queue.remove(entry)
        queue.append(entry)


class GroupedStore:
    """Entries by key and by group (parent hash or anchor), on a shared LRU free queue.

    Subclasses name an entry's key and group; an entry is in the free queue exactly while
    nothing references it, so eviction never takes one in use.
    """

    def __init__(self, free_queue: FreeQueue) -> None:
        self.free_queue = free_queue
        self._by_key: dict[BlockHash, Any] = {}
        self._groups: dict[BlockHash, dict[BlockHash, Any]] = {}
        self._next_id = 0
        self.nbytes = 0

    @staticmethod
    def key_of(entry: Any) -> BlockHash:
        raise NotImplementedError

    @staticmethod
    def group_of(entry: Any) -> BlockHash:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._by_key

    def get(self, key: BlockHash) -> Any | None:
        return self._by_key.get(key)

    def entries(self) -> list[Any]:
        return list(self._by_key.values())

    def group(self, group: BlockHash) -> Collection[Any]:
        return self._groups.get(group, {}).values()

    def _add(self, entry: Any) -> None:
        key = self.key_of(entry)
        self._by_key[key] = entry
        self._groups.setdefault(self.group_of(entry), {})[key] = entry
        self.nbytes += entry.nbytes
        self.free_queue.append(entry)

    def _owns(self, entry: Any) -> bool:
        return self._by_key.get(self.key_of(entry)) is entry

    def acquire(self, entry: Any) -> None:
        assert self._owns(entry), f"acquire of evicted {entry!r}"
        pin(entry, self.free_queue)

    def release(self, entry: Any) -> None:
        assert self._owns(entry), f"release of evicted {entry!r}"
        unpin(entry, self.free_queue)

    def refresh(self, entry: Any) -> None:
        refresh(entry, self.free_queue)

    def remove(self, entry: Any) -> None:
        """Forget an unreferenced entry, queued or already popped from the queue."""
        assert entry.ref_cnt == 0, f"remove of referenced {entry!r}"
        assert self._owns(entry), f"remove of unknown {entry!r}"
        if entry.prev_free is not None:
            self.free_queue.remove(entry)
        key, group = self.key_of(entry), self.group_of(entry)
        del self._by_key[key]
        siblings = self._groups[group]
        del siblings[key]
        if not siblings:
            del self._groups[group]
        self.nbytes -= entry.nbytes


class BlockPool(GroupedStore):
    """Blocks by hash, plus a children index (parent hash → blocks) for in-block prefix matching."""

    def __init__(self, free_queue: FreeQueue | None = None) -> None:
        # Shared with the checkpoint store, so one LRU order spans both kinds of entry.
        super().__init__(free_queue if free_queue is not None else FreeQueue())

    @staticmethod
    def key_of(entry: Block) -> BlockHash:
        return entry.hash

    @staticmethod
    def group_of(entry: Block) -> BlockHash:
        return entry.parent

    def children(self, parent: BlockHash) -> Collection[Block]:
        return self.group(parent)

    def insert(
        self,
        block_hash: BlockHash,
        parent: BlockHash,
        tokens: tuple[int, ...],
        payload: object,
        nbytes: int,
    ) -> tuple[Block, bool]:
        """The block stored under `block_hash` and whether it is new; an existing one wins."""
        block = self._by_key.get(block_hash)
        if block is not None:
            assert block.tokens == tokens, f"hash collision or caller bug: {block!r} vs {tokens}"
            return block, False
        block = Block(self._next_id, block_hash, parent, tokens, payload, nbytes)
        self._next_id += 1
        self._add(block)
        return block, True
