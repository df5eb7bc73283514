"""The store's placement and movement rules (pure), with exact expectations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.comm.policy import (
    HOST,
    RULE_EVEN,
    RULE_HOME,
    RULE_HOST,
    RULE_HOST_NO_AM,
    RULE_READER,
    GpuState,
    ItemState,
    Move,
    expired,
    over_capacity,
    place,
    plan_moves,
    relocate_on_read,
    store_capacity,
)

MB = 1_000_000


def gpus(*specs: tuple[float, int]) -> list[GpuState]:
    """GPUs 0.. from (capacity, used) pairs."""
    return [GpuState(i, cap, used) for i, (cap, used) in enumerate(specs)]


def test_capacity_is_a_fraction_of_predicted_idle_memory():
    assert store_capacity(1000, 0.5) == 500
    assert store_capacity(1001, 0.5) == 500  # floored: never more than the fraction
    assert store_capacity(-5, 0.5) == 0  # demand above the device: no room at all
    assert store_capacity(math.inf, 0.3) == math.inf
    with pytest.raises(ValueError, match="fraction"):
        store_capacity(10, 1.5)


def test_new_data_stays_home_when_it_fits():
    assert place(10, 1, gpus((100, 0), (100, 90)), adaptive=True) == (1, RULE_HOME)


def test_new_data_goes_to_the_lowest_fill_ratio_when_home_is_full():
    # Home (0) is full. GPU 1 would be (50+10)/100 = 0.6 full, GPU 2 (100+10)/400 = 0.275.
    assert place(10, 0, gpus((100, 95), (100, 50), (400, 100)), adaptive=True) == (2, RULE_EVEN)


def test_ties_go_to_the_lowest_index():
    assert place(10, 0, gpus((0, 0), (100, 0), (100, 0)), adaptive=True) == (1, RULE_EVEN)


def test_new_data_goes_to_host_without_am_or_when_every_gpu_is_full():
    assert place(10, 0, gpus((5, 0), (100, 0)), adaptive=False) == (HOST, RULE_HOST_NO_AM)
    assert place(10, 0, gpus((5, 0), (15, 10)), adaptive=True) == (HOST, RULE_HOST)


def test_unbounded_capacity_always_fits_home():
    assert place(10**12, 0, gpus((math.inf, 10**12)), adaptive=True) == (0, RULE_HOME)


def test_rule3_largest_items_leave_first_and_only_until_the_excess_is_covered():
    # GPU 0 holds 60 MB against a 35 MB capacity: 25 MB must go. Largest first: c (20) then b (15).
    items = [
        ItemState("a", 5 * MB, 0, seq=0),
        ItemState("b", 15 * MB, 0, seq=1),
        ItemState("c", 20 * MB, 0, seq=2),
        ItemState("d", 15 * MB, 0, seq=3),  # same size as b but newer: b goes first
        ItemState("e", 5 * MB, 0, seq=4),
    ]
    moves = plan_moves(gpus((35 * MB, 60 * MB), (100 * MB, 0)), items, adaptive=True)
    assert moves == [Move("c", 0, 1, 20 * MB, RULE_EVEN), Move("b", 0, 1, 15 * MB, RULE_EVEN)]


def test_rule3_overshoots_rather_than_picking_small_items():
    items = [ItemState("small", 1, 0, seq=0), ItemState("big", 100, 0, seq=1)]
    moves = plan_moves(gpus((100, 101), (1000, 0)), items, adaptive=True)
    assert [m.key for m in moves] == ["big"]


def test_rule2_targets_the_lowest_pressure_gpu_and_stays_even():
    # Two 10-byte items leave GPU 0. GPU 1 and 2 both have 100 capacity; GPU 1 starts at 10 used.
    # First item: GPU 2 (0.1) beats GPU 1 (0.2). Second: GPU 1 (0.2) ties GPU 2 (0.2) -> lowest index.
    items = [ItemState("x", 10, 0, seq=0), ItemState("y", 10, 0, seq=1)]
    moves = plan_moves(gpus((0, 20), (100, 10), (100, 0)), items, adaptive=True)
    assert moves == [Move("x", 0, 2, 10, RULE_EVEN), Move("y", 0, 1, 10, RULE_EVEN)]


def test_rule1_remote_reader_wins_over_lower_pressure():
    items = [ItemState("k", 10, 0, seq=0, last_reader=2)]
    moves = plan_moves(gpus((0, 10), (1000, 0), (100, 80)), items, adaptive=True)
    assert moves == [Move("k", 0, 2, 10, RULE_READER)]


def test_rule1_falls_back_to_rule2_when_the_reader_has_no_room():
    items = [ItemState("k", 10, 0, seq=0, last_reader=2)]
    moves = plan_moves(gpus((0, 10), (1000, 0), (100, 95)), items, adaptive=True)
    assert moves == [Move("k", 0, 1, 10, RULE_EVEN)]


def test_host_when_every_gpu_is_full_and_without_am():
    items = [ItemState("k", 10, 0, seq=0, last_reader=1)]
    assert plan_moves(gpus((0, 10), (15, 10)), items, adaptive=True) == [Move("k", 0, HOST, 10, RULE_HOST)]
    assert plan_moves(gpus((0, 10), (1000, 0)), items, adaptive=False) == [
        Move("k", 0, HOST, 10, RULE_HOST_NO_AM)
    ]


def test_held_items_and_host_items_never_move():
    items = [
        ItemState("held", 50, 0, seq=0, movable=False),
        ItemState("free", 10, 0, seq=1),
        ItemState("on-host", 99, HOST, seq=2),
    ]
    moves = plan_moves(gpus((0, 60), (1000, 0)), items, adaptive=True)
    assert moves == [Move("free", 0, 1, 10, RULE_EVEN)]  # all it can do; GPU 0 stays over


def test_within_capacity_nothing_moves():
    items = [ItemState("a", 10, 0, seq=0)]
    assert plan_moves(gpus((10, 10), (10, 0)), items, adaptive=True) == []


def test_need_moves_data_off_a_gpu_within_capacity_reactive_reclaim():
    items = [ItemState("a", 10, 0, seq=0), ItemState("b", 30, 0, seq=1), ItemState("c", 20, 0, seq=2)]
    moves = plan_moves(gpus((math.inf, 60), (math.inf, 0)), items, adaptive=False, need={0: 25})
    assert moves == [Move("b", 0, HOST, 30, RULE_HOST_NO_AM)]


def test_moves_into_a_gpu_never_push_it_over_its_capacity():
    # GPU 1 has 25 bytes of room: one 20-byte item fits, the second goes to host.
    items = [ItemState("a", 20, 0, seq=0), ItemState("b", 20, 0, seq=1)]
    moves = plan_moves(gpus((0, 40), (100, 75)), items, adaptive=True)
    assert moves == [Move("a", 0, 1, 20, RULE_EVEN), Move("b", 0, HOST, 20, RULE_HOST)]


def test_over_capacity_gpus_are_relieved_in_index_order_and_do_not_receive():
    items = [ItemState("a", 10, 0, seq=0), ItemState("b", 10, 1, seq=1)]
    moves = plan_moves(gpus((0, 10), (5, 10), (100, 0)), items, adaptive=True)
    assert moves == [Move("a", 0, 2, 10, RULE_EVEN), Move("b", 1, 2, 10, RULE_EVEN)]


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="described twice"):
        plan_moves([GpuState(0, 1, 0), GpuState(0, 1, 0)], [], adaptive=True)
    with pytest.raises(ValueError, match="undescribed GPU 3"):
        plan_moves(gpus((1, 0)), [ItemState("a", 1, 3, 0)], adaptive=True)
    with pytest.raises(ValueError, match="undescribed GPUs"):
        plan_moves(gpus((1, 0)), [], adaptive=True, need={5: 1})
    with pytest.raises(ValueError, match="home GPU 4"):
        place(1, 4, gpus((1, 0)), adaptive=True)
    with pytest.raises(ValueError, match="negative"):
        GpuState(0, -1, 0)


def test_rule1_at_get_time_relocates_only_with_am_room_and_reads_left():
    item = ItemState("k", 10, 0, seq=0)
    room = gpus((100, 0), (100, 0))
    assert relocate_on_read(item, 1, room, adaptive=True, reads_left=2)
    assert relocate_on_read(item, 1, room, adaptive=True, reads_left=None)  # unknown: more may come
    assert not relocate_on_read(item, 1, room, adaptive=True, reads_left=0)  # last read: no point
    assert not relocate_on_read(item, 1, room, adaptive=False, reads_left=2)
    assert not relocate_on_read(item, 0, room, adaptive=True, reads_left=2)  # already there
    assert not relocate_on_read(item, 1, gpus((100, 0), (15, 10)), adaptive=True, reads_left=2)
    on_host = ItemState("h", 10, HOST, seq=0)
    assert relocate_on_read(on_host, 0, room, adaptive=True, reads_left=1)


def test_expired_in_deadline_order_and_inclusive():
    deadlines = {"late": 5.0, "never": None, "early": 1.0, "now": 3.0, "future": 3.5}
    assert expired(deadlines, 3.0) == ["early", "now"]
    assert expired({}, 1.0) == []


@st.composite
def scenarios(draw):
    n = draw(st.integers(1, 4))
    caps = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    items = []
    used = [0] * n
    for i in range(draw(st.integers(0, 12))):
        loc = draw(st.sampled_from([*range(n), HOST]))
        size = draw(st.integers(1, 80))
        reader = draw(st.none() | st.integers(0, n - 1))
        items.append(ItemState(f"k{i}", size, loc, seq=i, last_reader=reader, movable=draw(st.booleans())))
        if loc != HOST:
            used[loc] += size
    return [GpuState(g, caps[g], used[g]) for g in range(n)], items, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_invariants(scenario):
    states, items, adaptive = scenario
    moves = plan_moves(states, items, adaptive=adaptive)
    if not over_capacity(states):  # the store's ticker skips the plan then: it must move nothing
        assert moves == []
    by_key = {it.key: it for it in items}
    used = {g.index: g.used for g in states}
    cap = {g.index: g.capacity for g in states}
    over_before = {g for g in used if used[g] > cap[g]}
    assert len({m.key for m in moves}) == len(moves)  # nothing moves twice
    for m in moves:
        it = by_key[m.key]
        assert it.movable and it.location == m.src != HOST and m.src in over_before and m.dst != m.src
        assert m.nbytes == it.nbytes
        used[m.src] -= m.nbytes
        if m.dst != HOST:
            used[m.dst] += m.nbytes
            assert used[m.dst] <= cap[m.dst]  # never pushes a GPU over (a relieved one may receive)
        if not adaptive:
            assert m.dst == HOST
    for g in over_before:  # each relieved GPU is within capacity, or has nothing movable left
        out = {m.key for m in moves if m.src == g}
        left = [it for it in items if it.location == g and it.movable and it.key not in out]
        assert used[g] <= cap[g] or not left
        sizes = [m.nbytes for m in moves if m.src == g]
        assert sizes == sorted(sizes, reverse=True)  # rule 3
