"""Mapping table (lazy allocation, eager recycling, nothing leaks) and the shared-weight cache."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.memory_pool.mapping_table import (
    HeldBuffer,
    MappingTable,
    RecycledAccess,
    UnknownVariable,
    WeightCache,
)


class FakeAllocator:
    """Hands out increasing addresses and records every call."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.next = 0x1000

    def __call__(self, nbytes: int) -> int:
        self.calls.append(nbytes)
        addr = self.next
        self.next += 0x1000
        return addr


def test_address_is_empty_until_first_access_then_allocated_once() -> None:
    t = MappingTable()
    alloc = FakeAllocator()
    t.register("f1", "resnet", "conv1.out", 4096, expected=3)
    assert t.entry("f1", "resnet", "conv1.out").address is None
    assert alloc.calls == [] and t.held_bytes == 0
    a = t.access("f1", "resnet", "conv1.out", alloc)
    b = t.access("f1", "resnet", "conv1.out", alloc)
    assert a == b == 0x1000
    assert alloc.calls == [4096]
    e = t.entry("f1", "resnet", "conv1.out")
    assert (e.accesses, e.address, e.recycled) == (2, 0x1000, False)
    assert t.held_bytes == 4096 and t.pending_reclaim == 0


def test_reaching_the_expected_count_makes_the_buffer_reclaimable_once() -> None:
    t = MappingTable()
    alloc = FakeAllocator()
    t.register("f1", "m", "x", 100, expected=2)
    t.register("f1", "m", "y", 200, expected=1)
    t.access("f1", "m", "x", alloc)
    assert t.reclaim() == []
    t.access("f1", "m", "y", alloc)  # y: 1 of 1 -> reclaimable
    t.access("f1", "m", "x", alloc)  # x: 2 of 2 -> reclaimable
    assert t.pending_reclaim == 2
    assert t.held_bytes == 300  # still held until handed over
    assert t.reclaim() == [HeldBuffer("f1", "m", "y", 0x2000, 200), HeldBuffer("f1", "m", "x", 0x1000, 100)]
    assert t.reclaim() == []
    assert t.held_bytes == 0 and t.peak_held_bytes == 300
    assert t.entry("f1", "m", "x").recycled
    with pytest.raises(RecycledAccess, match="expected 2"):
        t.access("f1", "m", "x", alloc)
    assert t.release_instance("f1") == []  # nothing left: no double hand-over


def test_access_past_the_expected_count_before_reclaim_is_refused() -> None:
    t = MappingTable()
    t.register("f1", "m", "x", 100, expected=1)
    t.access("f1", "m", "x", FakeAllocator())
    with pytest.raises(RecycledAccess):
        t.access("f1", "m", "x", FakeAllocator())  # the caller is about to free it


def test_failed_allocation_leaves_the_table_unchanged() -> None:
    t = MappingTable()
    t.register("f1", "m", "x", 100, expected=1)

    def oom(nbytes: int) -> int:
        raise MemoryError(f"no room for {nbytes}")

    with pytest.raises(MemoryError):
        t.access("f1", "m", "x", oom)
    e = t.entry("f1", "m", "x")
    assert (e.accesses, e.address, t.held_bytes, t.pending_reclaim) == (0, None, 0, 0)
    assert t.access("f1", "m", "x", FakeAllocator()) == 0x1000  # retry after the pool grew


def test_touch_is_access_row_by_row_without_lookups() -> None:
    t, ref = MappingTable(), MappingTable()
    for table in (t, ref):
        table.register_many("f1", "m", [("x", 100, 2), ("y", 200, 1), ("out", 300, None)])
    alloc, ref_alloc = FakeAllocator(), FakeAllocator()
    x, y, out = t.rows("f1", "m", ["x", "y", "out"])
    assert t.touch((x, y), alloc) == [0x1000, 0x2000]
    assert t.touch((x, out), alloc) == [0x1000, 0x3000]
    for var in ("x", "y", "x", "out"):  # the same accesses one by one
        ref.access("f1", "m", var, ref_alloc)
    spent = [HeldBuffer("f1", "m", "y", 0x2000, 200), HeldBuffer("f1", "m", "x", 0x1000, 100)]
    assert t.reclaim() == ref.reclaim() == spent
    assert (t.held_bytes, t.peak_held_bytes) == (ref.held_bytes, ref.peak_held_bytes) == (300, 600)
    with pytest.raises(RecycledAccess, match="expected 2"):
        t.touch((x,), alloc)
    with pytest.raises(UnknownVariable, match="'z'"):
        t.rows("f1", "m", ["z"])


def test_touch_recycling_hands_spent_addresses_back_at_once() -> None:
    t, ref = MappingTable(), MappingTable()
    for table in (t, ref):
        table.register_many("f1", "m", [("x", 100, 2), ("y", 200, 1), ("out", 300, None)])
    alloc, ref_alloc = FakeAllocator(), FakeAllocator()
    x, y, out = t.rows("f1", "m", ["x", "y", "out"])
    rx, ry, rout = ref.rows("f1", "m", ["x", "y", "out"])
    spent: list[int] = []
    assert t.touch_recycling((x, y), alloc, spent) == ref.touch((rx, ry), ref_alloc) == [0x1000, 0x2000]
    assert spent == [0x2000] and (t.touched_bytes, t.held_bytes, t.pending_reclaim) == (300, 100, 0)
    assert t.touch_recycling((x, out), alloc, spent) == ref.touch((rx, rout), ref_alloc) == [0x1000, 0x3000]
    assert spent == [0x2000, 0x1000]
    ref.reclaim()
    assert (t.touched_bytes, t.held_bytes, ref.held_bytes) == (400, 300, 300)  # x was live in its last kernel
    assert t.reclaim() == []
    with pytest.raises(RecycledAccess):
        t.touch_recycling((y,), alloc, spent)
    assert [h.address for h in t.release_instance("f1")] == [0x3000]  # only the output is still held


def test_unknown_variables_and_bad_registrations_raise_clear_errors() -> None:
    t = MappingTable()
    t.register("f1", "m", "x", 100, expected=1)
    with pytest.raises(UnknownVariable, match=r"'nope'.*registered: \['x'\]"):
        t.access("f1", "m", "nope", FakeAllocator())
    with pytest.raises(UnknownVariable):
        t.access("f2", "m", "x", FakeAllocator())
    with pytest.raises(UnknownVariable):
        t.entry("f1", "other", "x")
    with pytest.raises(ValueError, match="already registered"):
        t.register("f1", "m", "x", 100, expected=1)
    with pytest.raises(ValueError, match="expected accesses"):
        t.register("f1", "m", "y", 100, expected=0)
    with pytest.raises(ValueError, match="negative"):
        t.register("f1", "m", "y", -1, expected=1)


def test_release_instance_returns_everything_still_held_including_pending() -> None:
    t = MappingTable()
    alloc = FakeAllocator()
    t.register_many("f1", "m", [("a", 10, 1), ("b", 20, 5), ("c", 30, None), ("d", 40, 2)])
    t.register("f2", "m", "a", 50, expected=1)
    t.access("f1", "m", "a", alloc)  # pending reclaim, not yet handed over
    t.access("f1", "m", "b", alloc)  # held, 1 of 5 (the function crashed mid-way)
    t.access("f1", "m", "c", alloc)  # never recycled by count
    t.access("f2", "m", "a", alloc)  # another instance: untouched by f1's release
    held = t.release_instance("f1")
    assert held == [
        HeldBuffer("f1", "m", "a", 0x1000, 10),
        HeldBuffer("f1", "m", "b", 0x2000, 20),
        HeldBuffer("f1", "m", "c", 0x3000, 30),
    ]
    assert t.reclaim() == [HeldBuffer("f2", "m", "a", 0x4000, 50)]  # f1's "a" is not handed twice
    assert t.held_bytes == 0 and len(t) == 1 and t.instances() == ["f2"]
    assert t.release_instance("f1") == [] and t.release_instance("never") == []


def test_reset_instance_keeps_registrations_for_the_next_request() -> None:
    t = MappingTable()
    alloc = FakeAllocator()
    t.register_many("f1", "m", [("a", 10, 1), ("b", 20, 2)])
    t.access("f1", "m", "a", alloc)
    t.access("f1", "m", "b", alloc)
    assert t.reclaim() == [HeldBuffer("f1", "m", "a", 0x1000, 10)]
    assert t.reset_instance("f1") == [HeldBuffer("f1", "m", "b", 0x2000, 20)]
    assert [(e.var, e.accesses, e.address, e.recycled) for e in t.entries("f1")] == [
        ("a", 0, None, False),
        ("b", 0, None, False),
    ]
    assert t.access("f1", "m", "a", alloc) == 0x3000  # lazily allocated again
    assert t.held_bytes == 10


def test_without_eager_recycling_buffers_stay_until_release() -> None:
    t = MappingTable(eager_recycling=False)
    alloc = FakeAllocator()
    t.register_many("f1", "m", [("a", 10, 1), ("b", 20, 1)])
    assert t.materialize("f1", alloc) == 30  # the static baseline allocates up front
    assert alloc.calls == [10, 20]
    for _ in range(3):
        assert t.access("f1", "m", "a", alloc) == 0x1000  # more accesses than profiled: tolerated
    assert t.pending_reclaim == 0 and t.reclaim() == []
    assert alloc.calls == [10, 20]
    assert [h.var for h in t.release_instance("f1")] == ["a", "b"]


@settings(max_examples=200, deadline=None)
@given(
    plans=st.lists(
        st.lists(st.tuples(st.integers(0, 1 << 20), st.one_of(st.none(), st.integers(1, 4))), max_size=8),
        min_size=1,
        max_size=4,
    ),
    data=st.data(),
)
def test_every_allocated_buffer_is_handed_back_exactly_once(plans, data) -> None:  # type: ignore[no-untyped-def]
    t = MappingTable()
    alloc = FakeAllocator()
    allocated: dict[int, int] = {}

    def allocate(nbytes: int) -> int:
        addr = alloc(nbytes)
        allocated[addr] = nbytes
        return addr

    remaining: dict[tuple[int, str], int] = {}
    for inst, plan in enumerate(plans):
        for v, (nbytes, expected) in enumerate(plan):
            t.register(inst, "m", f"v{v}", nbytes, expected)
            remaining[(inst, f"v{v}")] = expected if expected is not None else 3
    handed: list[HeldBuffer] = []
    steps = data.draw(st.lists(st.sampled_from(["access", "reclaim", "release"]), max_size=40))
    for step in steps:
        if step == "access":
            live = [k for k, n in remaining.items() if n > 0]
            if live:
                inst, var = data.draw(st.sampled_from(live))
                t.access(inst, "m", var, allocate)
                remaining[(inst, var)] -= 1
        elif step == "reclaim":
            handed += t.reclaim()
        else:
            inst = data.draw(st.integers(0, len(plans) - 1))
            handed += t.release_instance(inst)
            remaining = {k: n for k, n in remaining.items() if k[0] != inst}
        assert t.held_bytes == sum(allocated.values()) - sum(h.nbytes for h in handed)
    for inst in range(len(plans)):
        handed += t.release_instance(inst)
    handed += t.reclaim()
    assert sorted(h.address for h in handed) == sorted(allocated)  # each exactly once
    assert {h.address: h.nbytes for h in handed} == allocated
    assert t.held_bytes == 0 and len(t) == 0


# -- WeightCache ----------------------------------------------------------------------------------


def test_weight_cache_refcounts_and_idle_since() -> None:
    w = WeightCache()
    assert w.acquire("bert", now=1.0) is True  # not cached: load the weights
    assert w.acquire("bert", now=2.0) is False  # shared with the second instance
    assert w.users("bert") == 2 and w.idle_since("bert") is None
    assert w.release("bert", now=3.0) == 1
    assert w.idle_since("bert") is None
    assert w.release("bert", now=4.0) == 0
    assert w.idle_since("bert") == 4.0 and "bert" in w
    assert w.acquire("bert", now=5.0) is False  # still cached: no reload
    assert w.idle_since("bert") is None
    with pytest.raises(ValueError, match="without a matching acquire"):
        w.release("gpt", now=6.0)
    w.release("bert", now=6.0)
    with pytest.raises(ValueError, match="without a matching acquire"):
        w.release("bert", now=7.0)
    assert w.users("unknown") == 0 and w.idle_since("unknown") is None


def test_weight_cache_expires_only_idle_models_after_keep_alive() -> None:
    w = WeightCache()
    for model, t in (("a", 0.0), ("b", 0.0), ("c", 0.0)):
        w.acquire(model, now=t)
    w.release("b", now=10.0)
    w.release("a", now=12.0)  # "c" stays in use
    assert w.expired(now=15.0, keep_alive_s=5.0) == []  # b idle exactly 5 s: not longer
    assert w.expired(now=15.5, keep_alive_s=5.0) == ["b"]
    assert w.expired(now=100.0, keep_alive_s=5.0) == ["b", "a"]  # oldest first, never "c"
    assert w.expired(now=1e9, keep_alive_s=0.0) == ["b", "a"]
    with pytest.raises(ValueError, match="users"):
        w.evict("c")
    w.evict("b")
    assert w.models() == ["a", "c"] and "b" not in w
    with pytest.raises(KeyError, match="not cached"):
        w.evict("b")
    with pytest.raises(ValueError):
        w.expired(now=0.0, keep_alive_s=-1.0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.booleans(), st.floats(0, 10)), max_size=40))
def test_weight_cache_never_expires_a_model_with_users(ops) -> None:  # type: ignore[no-untyped-def]
    w = WeightCache()
    users = {m: 0 for m in "abc"}
    now = 0.0
    for model, acquire, dt in ops:
        now += dt
        if acquire:
            w.acquire(model, now)
            users[model] += 1
        elif users[model]:
            w.release(model, now)
            users[model] -= 1
        for m in w.expired(now, keep_alive_s=1.0):
            assert users[m] == 0
            assert now - (w.idle_since(m) or 0.0) > 1.0
        assert all(w.users(m) == n for m, n in users.items())


def test_place_and_retire_keep_the_table_true_for_a_scheduled_run() -> None:
    t = MappingTable()
    t.register_many("f1", "m", [("x", 100, 1), ("y", 200, None)])
    x, y = t.rows("f1", "m", ["x", "y"])
    t.place([x, y], [0x1000, 0x2000])
    assert (x.address, y.address, t.held_bytes, t.allocations) == (0x1000, 0x2000, 300, 2)
    assert t.peak_held_bytes == 300
    spent: list[int] = []
    t.retire([x], spent)
    assert spent == [0x1000] and (x.address, x.recycled, t.held_bytes) == (None, True, 200)
    assert [h.var for h in t.release_instance("f1")] == ["y"]  # what is still held comes back, once
