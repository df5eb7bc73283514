"""The block scheduler: round-robin batches, preemption at batch boundaries, per-function order, and
fairness by hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.io_daemon.blocks import Block, Piece
from streambox.io_daemon.scheduler import BlockScheduler


def blocks(function, n, first=0):
    return [Block(function, 0, first + i, (Piece(0, 0, 1),)) for i in range(n)]


def names(batch):
    return [(b.function, b.seq) for b in batch]


def test_round_robin_batches_of_six():
    s = BlockScheduler(batch_blocks=6)
    s.submit("a", blocks("a", 5))
    s.submit("b", blocks("b", 2))
    assert names(s.next_batch()) == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("a", 3)]
    assert names(s.next_batch()) == [("a", 4)]
    assert s.next_batch() == [] and not s
    assert s.batches == 2


def test_newcomer_preempts_at_the_next_batch_boundary():
    s = BlockScheduler(batch_blocks=3)
    s.submit("big", blocks("big", 9))
    assert names(s.next_batch()) == [("big", 0), ("big", 1), ("big", 2)]
    s.submit("small", blocks("small", 2))  # arrives while that batch is on the link
    # not a block of it before the boundary; at the boundary it goes first, then takes turns
    assert names(s.next_batch()) == [("small", 0), ("big", 3), ("small", 1)]
    assert names(s.next_batch()) == [("big", 4), ("big", 5), ("big", 6)]


def test_several_newcomers_join_in_arrival_order_ahead_of_the_ring():
    s = BlockScheduler(batch_blocks=4)
    s.submit("a", blocks("a", 5))
    s.next_batch()
    s.submit("a", blocks("a", 2, first=5))  # still in the ring: no preemption, just more blocks
    s.submit("b", blocks("b", 1))
    s.submit("c", blocks("c", 1))
    assert names(s.next_batch()) == [("b", 0), ("c", 0), ("a", 4), ("a", 5)]
    s.submit("e", blocks("e", 3))
    assert names(s.next_batch()) == [("e", 0), ("a", 6), ("e", 1), ("e", 2)]
    # "a" ran dry and left the ring: its next request is a newcomer again, in arrival order
    s.submit("a", blocks("a", 2, first=7))
    s.submit("d", blocks("d", 1))
    assert names(s.next_batch()) == [("a", 7), ("d", 0), ("a", 8)]


def test_batch_of_one_is_bt_off():
    s = BlockScheduler(batch_blocks=1)
    s.submit("a", blocks("a", 2))
    s.submit("b", blocks("b", 1))
    assert [names(s.next_batch()) for _ in range(3)] == [[("a", 0)], [("b", 0)], [("a", 1)]]


def test_cancel_drops_queued_blocks_and_out_of_order_submit_is_refused():
    s = BlockScheduler(batch_blocks=2)
    s.submit("a", blocks("a", 3))
    s.submit("b", blocks("b", 3))
    s.next_batch()
    assert len(s.cancel("a")) == 2
    assert s.queued_blocks() == 2 and s.queued_blocks("a") == 0
    assert names(s.next_batch()) == [("b", 1), ("b", 2)]
    s.submit("c", blocks("c", 2, first=5))
    with pytest.raises(ValueError, match="seq"):
        s.submit("c", blocks("c", 1, first=5))
    with pytest.raises(ValueError, match="at least one"):
        BlockScheduler(batch_blocks=0)


arrivals_st = st.lists(
    st.tuples(st.integers(0, 4), st.integers(0, 6)),  # (function, blocks) submitted at a boundary
    min_size=1,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(arrivals=arrivals_st, batch_blocks=st.integers(1, 7), gaps=st.lists(st.integers(0, 3), max_size=30))
def test_order_fairness_and_preemption(arrivals, batch_blocks, gaps):
    s = BlockScheduler(batch_blocks)
    next_seq: dict[int, int] = {}
    served: list[list[Block]] = []
    submitted: dict[int, int] = {}
    queue = list(arrivals)
    step = 0
    while queue or s:
        # some arrivals, then a few batch boundaries
        for _ in range(1 + (gaps[step] if step < len(gaps) else 0)):
            if not queue:
                break
            function, n = queue.pop(0)
            first = next_seq.get(function, 0)
            s.submit(function, blocks(function, n, first))
            next_seq[function] = first + n
            submitted[function] = submitted.get(function, 0) + n
        step += 1
        before = {f: s.queued_blocks(f) for f in range(5)}
        batch = s.next_batch()
        served.append(batch)
        assert len(batch) <= batch_blocks
        # work conserving: a batch is full unless everything queued is in it
        assert len(batch) == min(batch_blocks, sum(before.values()))
        # round-robin fairness inside a batch: functions that still had blocks are served a number of
        # times that differs by at most one
        counts = {f: sum(b.function == f for b in batch) for f in before if before[f]}
        still = {f: c for f, c in counts.items() if c < before[f]}  # not drained by this batch
        if still:
            assert max(counts.values()) - min(still.values()) <= 1
    flat = [b for batch in served for b in batch]
    # every block exactly once, and per function in order
    for f, n in submitted.items():
        assert [b.seq for b in flat if b.function == f] == list(range(n))
    assert len(flat) == sum(submitted.values())


def test_newcomer_waits_at_most_one_batch_boundary():
    """However long the resident queue, a new function's first block is in the very next batch."""
    for batch_blocks in (1, 2, 6):
        s = BlockScheduler(batch_blocks)
        s.submit("big", blocks("big", 100))
        s.next_batch()
        s.submit("new", blocks("new", 3))
        assert s.next_batch()[0].function == "new"
