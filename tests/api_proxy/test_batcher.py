"""The batch-gathering policy: exact closes by size, by deadline, by overflow, per kind."""

from __future__ import annotations

import pytest

from streambox.api_proxy.batcher import Gatherer, Limits

FOUR_IN_5MS = Limits(max_samples=4, max_delay_s=0.005)


def test_a_batch_closes_when_full():
    g: Gatherer[str] = Gatherer()
    first, closed = g.add("k", "a", 1, FOUR_IN_5MS, now=0.0)
    assert closed == [] and g.next_deadline() == 0.005
    for name, now in (("b", 0.001), ("c", 0.002)):
        assert g.add("k", name, 1, FOUR_IN_5MS, now=now) == (first, [])
    batch, closed = g.add("k", "d", 1, FOUR_IN_5MS, now=0.003)
    assert closed == [first] and batch is first
    assert (first.members, first.total, first.leader) == (["a", "b", "c", "d"], 4, "a")
    assert g.next_deadline() is None and len(g) == 0


def test_a_batch_closes_at_its_first_members_deadline():
    g: Gatherer[str] = Gatherer()
    batch, _ = g.add("k", "a", 1, FOUR_IN_5MS, now=1.0)
    g.add("k", "b", 1, FOUR_IN_5MS, now=1.004)
    assert g.due(1.0049) == []
    assert g.due(1.005) == [batch] and batch.members == ["a", "b"]
    assert g.due(2.0) == []  # closed once


def test_a_member_that_would_overflow_closes_the_open_batch_and_leads_the_next():
    g: Gatherer[str] = Gatherer()
    first, _ = g.add("k", "a", 3, FOUR_IN_5MS, now=0.0)
    second, closed = g.add("k", "b", 2, FOUR_IN_5MS, now=0.002)
    assert closed == [first] and first.members == ["a"]
    assert second.leader == "b" and second.deadline == pytest.approx(0.007)


def test_kinds_gather_apart_and_close_in_deadline_order():
    g: Gatherer[str] = Gatherer()
    late, _ = g.add("resnet", "a", 1, Limits(4, 0.010), now=0.0)
    early, _ = g.add("vgg", "b", 1, Limits(4, 0.002), now=0.001)
    g.add("vgg", "c", 1, Limits(4, 0.002), now=0.0015)
    assert g.next_deadline() == pytest.approx(0.003)
    assert g.due(0.020) == [early, late]
    assert (early.members, late.members) == (["b", "c"], ["a"])


def test_no_delay_closes_every_member_alone_and_discard_drops_an_open_batch():
    g: Gatherer[str] = Gatherer()
    batch, closed = g.add("k", "a", 1, Limits(4, 0.0), now=0.0)
    assert closed == [batch]
    open_batch, _ = g.add("k", "b", 1, FOUR_IN_5MS, now=0.0)
    assert g.discard(open_batch) and not g.discard(open_batch) and g.due(1.0) == []


def test_bad_limits_and_samples_are_refused():
    with pytest.raises(ValueError, match="max_samples >= 1"):
        Limits(0, 0.001)
    with pytest.raises(ValueError, match="at least one sample"):
        Gatherer().add("k", "a", 0, FOUR_IN_5MS, now=0.0)


def test_a_batch_handed_on_is_led_by_the_successor_and_has_room_for_the_leavers_samples():
    g: Gatherer[str] = Gatherer()
    batch, _ = g.add("k", "a", 2, FOUR_IN_5MS, now=0.0)
    g.add("k", "b", 1, FOUR_IN_5MS, now=0.001)
    g.add("k", "c", 1, FOUR_IN_5MS, now=0.002)  # full: closed
    assert not g.is_open(batch)
    batch.hand_on("a", "c")
    assert (batch.leader, batch.members, batch.samples) == ("c", ["c", "b"], [1, 1])
    reopened, _ = g.add("k", "d", 2, FOUR_IN_5MS, now=0.003)
    assert g.is_open(reopened)
    g.add("k", "e", 1, FOUR_IN_5MS, now=0.004)
    reopened.hand_on("d", "e")  # still open, now with one sample of four: it waits for more
    assert g.is_open(reopened) and (reopened.members, reopened.total) == (["e"], 1)


def test_a_member_that_leaves_an_open_batch_takes_its_samples_out():
    g: Gatherer[str] = Gatherer()
    batch, _ = g.add("k", "a", 1, FOUR_IN_5MS, now=0.0)
    g.add("k", "b", 2, FOUR_IN_5MS, now=0.001)
    assert g.leave(batch, "b") and (batch.members, batch.total) == (["a"], 1)
    assert g.add("k", "c", 2, FOUR_IN_5MS, now=0.002) == (batch, [])  # 1 + 2 fit: b's room is free
    assert not g.leave(batch, "b")  # not in it any more
    g.add("k", "d", 1, FOUR_IN_5MS, now=0.003)  # full: closed
    assert not g.leave(batch, "c") and batch.members == ["a", "c", "d"]  # a closed batch is its runner's
    alone, _ = g.add("k", "e", 1, FOUR_IN_5MS, now=0.004)
    assert g.leave(alone, "e") and not g.is_open(alone) and g.next_deadline() is None


def test_a_batch_closes_at_its_most_members():
    pair = Limits(max_samples=4, max_delay_s=0.005, max_members=2)
    g: Gatherer[str] = Gatherer()
    batch, closed = g.add("k", "a", 1, pair, now=0.0)
    assert closed == []
    assert g.add("k", "b", 1, pair, now=0.001) == (batch, [batch])  # 2 of 4 samples, but 2 members
    one, closed = g.add("k", "c", 1, Limits(4, 0.005, max_members=1), now=0.002)
    assert closed == [one]  # nobody else could be waiting: closed at once
    with pytest.raises(ValueError, match="max_members >= 1"):
        Limits(4, 0.005, max_members=0)
