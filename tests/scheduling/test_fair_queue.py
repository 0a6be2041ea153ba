"""The wait queue takes tenants in turn, then sessions in turn, and keeps each session's order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine_bridge.scheduling.fair_queue import FairQueue


def test_a_flood_waits_behind_everyone_elses_next_request():
    q: FairQueue[str] = FairQueue()
    for i in range(5):
        q.push("alice", "s1", f"a{i}")
    q.push("alice", "s2", "a-other")
    q.push("bob", "s9", "b0")
    q.push("bob", "s9", "b1")
    order = [q.pop() for _ in range(len(q))]
    # Tenants alternate; alice's two sessions alternate within her turns.
    assert order == ["a0", "b0", "a-other", "b1", "a1", "a2", "a3", "a4"]
    assert len(q) == 0


def test_remove_if_keeps_the_order_of_what_stays():
    q: FairQueue[int] = FairQueue()
    for i in range(6):
        q.push("t", "s", i)
    assert q.remove_if(lambda x: x % 2 == 0) == [0, 2, 4]
    assert len(q) == 3 and q.peek() == 1
    assert [q.pop() for _ in range(3)] == [1, 3, 5]


@given(
    st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from("xyz"), st.integers()), max_size=40)
)
def test_every_item_comes_out_once_and_each_session_in_order(pushes):
    q: FairQueue[tuple] = FairQueue()
    for i, (tenant, session, _) in enumerate(pushes):
        q.push(tenant, session, (tenant, session, i))
    assert len(q) == len(pushes)
    out = []
    while len(q):
        head = q.peek()
        item = q.pop()
        assert head == item
        out.append(item)
    assert sorted(i for *_, i in out) == list(range(len(pushes)))
    for lane in {(t, s) for t, s, _ in pushes}:
        seq = [i for t, s, i in out if (t, s) == lane]
        assert seq == sorted(seq)


def test_pop_first_passes_over_a_session_that_must_wait_and_keeps_its_place():
    q: FairQueue[str] = FairQueue()
    q.push("t", "a", "a0")
    q.push("t", "b", "b0")
    q.push("t", "b", "b1")
    assert q.pop_first(lambda x: not x.startswith("a")) == "b0"
    assert q.pop_first(lambda x: False) is None
    assert q.pop() == "a0"  # a kept its place at the front
    q.push_front("t", "b", "b0")  # put back, first in line again
    assert [q.pop() for _ in range(len(q))] == ["b0", "b1"]
