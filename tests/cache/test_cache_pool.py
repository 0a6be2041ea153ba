from dataclasses import dataclass

import pytest

from engine_bridge.cache.ram.pool import BlockPool, FreeQueue


@dataclass(slots=True, eq=False)
class Node:
    name: str
    nbytes: int = 1
    ref_cnt: int = 0
    prev_free: object = None
    next_free: object = None


@dataclass(frozen=True, slots=True)
class FakePayload:
    nbytes: int


def h(i: int) -> bytes:
    return bytes([i]) * 32


ROOT = h(255)


def names(queue: FreeQueue) -> list[str]:
    return [node.name for node in queue]


def ids(queue: FreeQueue) -> list[int]:
    return [block.block_id for block in queue]


def test_free_queue_pops_in_append_order():
    queue = FreeQueue()
    a, b, c = Node("a", 1), Node("b", 2), Node("c", 4)
    for node in (a, b, c):
        queue.append(node)
    assert (len(queue), queue.nbytes, names(queue)) == (3, 7, ["a", "b", "c"])
    assert queue.peekleft() is a
    assert queue.popleft() is a
    assert (len(queue), queue.nbytes, names(queue)) == (2, 6, ["b", "c"])
    assert a.prev_free is None and a.next_free is None


def test_free_queue_removes_from_middle_head_and_tail():
    queue = FreeQueue()
    nodes = [Node(n) for n in "abcde"]
    for node in nodes:
        queue.append(node)
    queue.remove(nodes[2])
    queue.remove(nodes[0])
    queue.remove(nodes[4])
    assert names(queue) == ["b", "d"]
    queue.append(nodes[2])
    assert names(queue) == ["b", "d", "c"]
    assert [queue.popleft().name for _ in range(3)] == ["b", "d", "c"]
    assert len(queue) == 0 and queue.nbytes == 0 and queue.peekleft() is None


def test_free_queue_rejects_double_append_and_foreign_remove():
    queue = FreeQueue()
    a = Node("a")
    queue.append(a)
    with pytest.raises(AssertionError, match="already queued"):
        queue.append(a)
    with pytest.raises(AssertionError, match="not queued"):
        queue.remove(Node("b"))
    queue.popleft()
    with pytest.raises(AssertionError, match="empty"):
        queue.popleft()


def test_new_blocks_get_sequential_ids_and_queue_in_insert_order():
    pool = BlockPool()
    blocks = [pool.insert(h(i), ROOT, (i,), FakePayload(10), 10)[0] for i in range(3)]
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [0, 0, 0]
    assert ids(pool.free_queue) == [0, 1, 2]
    assert (len(pool), pool.nbytes, pool.free_queue.nbytes) == (3, 30, 30)


def test_insert_of_existing_hash_keeps_the_first_payload():
    pool = BlockPool()
    first = FakePayload(10)
    block, created = pool.insert(h(1), ROOT, (1, 2), first, 10)
    again, created_again = pool.insert(h(1), ROOT, (1, 2), FakePayload(10), 10)
    assert (created, created_again) == (True, False)
    assert again is block and again.payload is first
    assert (len(pool), pool.nbytes) == (1, 10)


def test_acquire_leaves_queue_and_release_returns_to_tail():
    pool = BlockPool()
    b0, b1, b2 = (pool.insert(h(i), ROOT, (i,), FakePayload(1), 1)[0] for i in range(3))
    pool.acquire(b0)
    pool.acquire(b1)
    assert (b0.ref_cnt, b1.ref_cnt, b2.ref_cnt) == (1, 1, 0)
    assert ids(pool.free_queue) == [2]
    assert pool.free_queue.nbytes == 1
    pool.release(b1)
    pool.release(b0)
    assert ids(pool.free_queue) == [2, 1, 0]


def test_block_shared_by_100_sessions_is_stored_once():
    pool = BlockPool()
    for _ in range(100):
        block, _ = pool.insert(h(7), ROOT, (7,), FakePayload(64), 64)
        pool.acquire(block)
    assert (len(pool), pool.nbytes, block.ref_cnt, len(pool.free_queue)) == (1, 64, 100, 0)
    for _ in range(99):
        pool.release(block)
    assert (block.ref_cnt, len(pool.free_queue)) == (1, 0)
    pool.release(block)
    assert (block.ref_cnt, ids(pool.free_queue)) == (0, [0])


def test_release_below_zero_is_an_error():
    pool = BlockPool()
    block, _ = pool.insert(h(1), ROOT, (1,), FakePayload(1), 1)
    with pytest.raises(AssertionError, match="unreferenced"):
        pool.release(block)


def test_refresh_moves_only_unreferenced_blocks_to_the_tail():
    pool = BlockPool()
    b0, b1, b2 = (pool.insert(h(i), ROOT, (i,), FakePayload(1), 1)[0] for i in range(3))
    pool.refresh(b0)
    assert ids(pool.free_queue) == [1, 2, 0]
    pool.acquire(b1)
    pool.refresh(b1)
    assert ids(pool.free_queue) == [2, 0]
    assert b1.ref_cnt == 1


def test_children_index_follows_insert_and_remove():
    pool = BlockPool()
    a, _ = pool.insert(h(1), ROOT, (1, 2), FakePayload(1), 1)
    b, _ = pool.insert(h(2), ROOT, (1, 3), FakePayload(1), 1)
    c, _ = pool.insert(h(3), h(1), (4, 5), FakePayload(1), 1)
    assert list(pool.children(ROOT)) == [a, b]
    assert list(pool.children(h(1))) == [c]
    assert list(pool.children(h(9))) == []
    pool.remove(a)
    assert list(pool.children(ROOT)) == [b]
    assert h(1) not in pool and pool.get(h(1)) is None
    assert ids(pool.free_queue) == [1, 2]
    assert pool.nbytes == 2


def test_remove_of_popped_block_and_of_referenced_block():
    pool = BlockPool()
    a, _ = pool.insert(h(1), ROOT, (1,), FakePayload(5), 5)
    b, _ = pool.insert(h(2), ROOT, (2,), FakePayload(5), 5)
    assert pool.free_queue.popleft() is a
    pool.remove(a)
    assert (len(pool), pool.nbytes) == (1, 5)
    pool.acquire(b)
    with pytest.raises(AssertionError, match="referenced"):
        pool.remove(b)
