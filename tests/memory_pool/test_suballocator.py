"""The sub-allocator: best-fit with split and coalesce, exact stats, chunk release; invariants by
hypothesis (no overlap, everything inside chunks, everything back to the device after freeing)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streambox.device.base import ALIGNMENT, InvalidAddress, aligned
from streambox.memory_pool.suballocator import (
    DoubleFree,
    SubAllocator,
    SubAllocatorStats,
    UnknownAddress,
)

KiB = 1 << 10
MiB = 1 << 20
BASE = 1 << 32


def free_blocks(sa: SubAllocator) -> list[tuple[int, int]]:
    return [(b.address, b.size) for b in sa.blocks() if not b.used]


def test_allocate_aligns_and_stays_inside_the_chunk() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 1 * MiB)
    a = sa.allocate(1)
    b = sa.allocate(257)
    c = sa.allocate(0)
    assert (a, b, c) == (BASE, BASE + 256, BASE + 768)
    assert [sa.size_of(x) for x in (a, b, c)] == [256, 512, 256]
    assert all(x % ALIGNMENT == 0 for x in (a, b, c))
    with pytest.raises(ValueError, match="negative"):
        sa.allocate(-1)


def test_allocate_returns_none_when_nothing_fits_and_counts_it() -> None:
    sa = SubAllocator()
    assert sa.allocate(256) is None  # no chunk at all: the shell must grow
    sa.add_chunk(BASE, 4 * KiB)
    assert sa.allocate(4 * KiB + 1) is None
    assert sa.allocate(4 * KiB) == BASE
    assert sa.allocate(1) is None
    assert sa.stats().failed_allocations == 3


def test_best_fit_takes_the_smallest_hole_that_fits() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 64 * KiB)
    # layout: [1K hole][x][512 hole][x][2K hole][x][rest]
    h1, x1, h2, x2, h3, x3 = (sa.allocate(n) for n in (1024, 256, 512, 256, 2048, 256))
    for h in (h1, h2, h3):
        sa.free(h)
    assert sa.allocate(300) == h2  # 512 is the best fit for 300 -> 512
    assert sa.allocate(1000) == h1  # then 1K
    got = sa.allocate(1500)  # only the 2K hole (or the tail) fits: best fit is the 2K hole
    assert got == h3
    assert free_blocks(sa) == [(h3 + 1536, 512), (x3 + 256, 64 * KiB - (x3 + 256 - BASE))]
    assert [sa.size_of(x) for x in (x1, x2, x3)] == [256, 256, 256]


def test_split_keeps_the_tail_free_and_free_coalesces_in_any_order() -> None:
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1], [2, 0, 1], [1, 2, 0]):
        sa = SubAllocator()
        sa.add_chunk(BASE, 16 * KiB)
        blocks = [sa.allocate(4 * KiB) for _ in range(3)]
        assert free_blocks(sa) == [(BASE + 12 * KiB, 4 * KiB)]
        for i in order:
            sa.free(blocks[i])
        assert free_blocks(sa) == [(BASE, 16 * KiB)], order
        assert sa.releasable_chunks() == [(BASE, 16 * KiB)]


def test_allocate_at_takes_an_address_back_from_the_free_block_that_holds_it() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 16 * KiB)
    a, b, c = (sa.allocate(4 * KiB) for _ in range(3))
    sa.free(a)
    sa.free(b)  # merged with a: the free block starts at a, not b
    assert sa.allocate_at(b, 4 * KiB) == b  # split around it
    assert free_blocks(sa) == [(a, 4 * KiB), (c + 4 * KiB, 4 * KiB)]
    assert sa.allocate_at(c, 256) is None  # c is in use
    assert sa.allocate_at(a + 256, 4 * KiB) is None  # runs into b
    assert sa.allocate_at(a, 4 * KiB) == a  # a free block's own start
    assert sa.allocate_at(BASE + 64 * KiB, 256) is None  # no chunk there
    assert sa.stats().allocated_bytes == 12 * KiB
    for x in (a, b, c):
        sa.free(x)
    assert free_blocks(sa) == [(BASE, 16 * KiB)]


def test_no_merge_across_contiguous_chunks() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 8 * KiB)
    sa.add_chunk(BASE + 8 * KiB, 8 * KiB)  # the device may hand out adjacent chunks
    a = sa.allocate(8 * KiB)
    b = sa.allocate(8 * KiB)
    assert {a, b} == {BASE, BASE + 8 * KiB}
    assert sa.allocate(256) is None
    sa.free(a)
    sa.free(b)
    assert free_blocks(sa) == [(BASE, 8 * KiB), (BASE + 8 * KiB, 8 * KiB)]
    assert sa.releasable_chunks() == [(BASE, 8 * KiB), (BASE + 8 * KiB, 8 * KiB)]
    assert sa.allocate(16 * KiB) is None  # a block never spans two chunks


def test_double_free_and_unknown_addresses_raise_clear_errors() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 64 * KiB)
    a = sa.allocate(1024)
    b = sa.allocate(1024)
    sa.free(b)  # b merges with the tail: b is the start of a free block
    with pytest.raises(DoubleFree, match="double free"):
        sa.free(b)
    sa.free(a)  # a's block merges with the free block at b
    with pytest.raises(DoubleFree):
        sa.free(a)  # a is the start of the merged free block
    c = sa.allocate(2048)
    d = sa.allocate(1024)
    sa.free(d)  # merges into the free tail; c stays live
    with pytest.raises(UnknownAddress, match="no live allocation"):
        sa.free(c + 256)  # inside a live block
    with pytest.raises(UnknownAddress):
        sa.free(12345)
    with pytest.raises(UnknownAddress, match="None"):
        sa.free(None)  # type: ignore[arg-type]  # e.g. an unchecked failed allocate
    assert issubclass(DoubleFree, InvalidAddress) and issubclass(UnknownAddress, InvalidAddress)
    assert sa.stats().live_allocations == 1


def test_add_chunk_validates_alignment_and_overlap() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 8 * KiB)
    with pytest.raises(ValueError, match="multiples of 256"):
        sa.add_chunk(BASE + 100 * KiB + 1, 8 * KiB)
    with pytest.raises(ValueError, match="multiples of 256"):
        sa.add_chunk(BASE + 100 * KiB, 1000)
    with pytest.raises(ValueError, match="overlaps"):
        sa.add_chunk(BASE + 4 * KiB, 8 * KiB)
    with pytest.raises(ValueError, match="overlaps"):
        sa.add_chunk(BASE - 4 * KiB, 8 * KiB)
    with pytest.raises(ValueError, match="overlaps"):
        sa.add_chunk(BASE - 4 * KiB, 64 * KiB)
    with pytest.raises(ValueError, match="size > 0"):
        sa.add_chunk(BASE + 64 * KiB, 0)
    assert sa.chunks() == [(BASE, 8 * KiB)]


def test_remove_chunk_only_when_fully_free() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 8 * KiB)
    sa.add_chunk(2 * BASE, 4 * KiB)
    a = sa.allocate(8 * KiB)
    assert sa.releasable_chunks() == [(2 * BASE, 4 * KiB)]
    with pytest.raises(ValueError, match="live allocations"):
        sa.remove_chunk(BASE)
    with pytest.raises(UnknownAddress, match="no chunk"):
        sa.remove_chunk(3 * BASE)
    assert sa.remove_chunk(2 * BASE) == 4 * KiB
    assert sa.reserved_bytes == 8 * KiB
    assert sa.allocate(256) is None
    sa.free(a)
    assert sa.remove_chunk(BASE) == 8 * KiB
    assert sa.stats() == SubAllocatorStats(0, 0, 8 * KiB, 0, 0, 0.0, 0, 0, 0, 1, 1, 1)


def test_trim_plan_releases_largest_free_chunks_down_to_keep_bytes() -> None:
    sa = SubAllocator()
    for i, size in enumerate((2 * MiB, 8 * MiB, 4 * MiB, 2 * MiB)):
        sa.add_chunk((i + 1) * BASE, size)
    busy = sa.allocate(8 * MiB)  # pins the 8 MiB chunk
    assert sa.chunk_of(busy) == 2 * BASE
    assert sa.trim_plan(0) == [3 * BASE, BASE, 4 * BASE]
    assert sa.trim_plan(11 * MiB) == [3 * BASE]  # 16 - 4 = 12; another 2 MiB would leave 10 < 11
    assert sa.trim_plan(10 * MiB) == [3 * BASE, BASE]  # 16 - 4 - 2 = 10 >= 10
    assert sa.trim_plan(13 * MiB) == [BASE]  # 4 MiB would leave 12 < 13; a 2 MiB chunk fits
    assert sa.trim_plan(16 * MiB) == []
    with pytest.raises(ValueError):
        sa.trim_plan(-1)


def test_stats_are_exact() -> None:
    sa = SubAllocator()
    sa.add_chunk(BASE, 16 * KiB)
    sa.add_chunk(2 * BASE, 4 * KiB)
    a = sa.allocate(1000)  # 1024 from the 4 KiB chunk (best fit: 4 KiB < 16 KiB)
    b = sa.allocate(4 * KiB)  # only the 16 KiB chunk fits
    c = sa.allocate(2 * KiB)  # best fit: the 3 KiB left in the small chunk, not 12 KiB
    assert (a, b, c) == (2 * BASE, BASE, 2 * BASE + 1024)
    sa.free(b)  # merges back with the 12 KiB tail
    s = sa.stats()
    assert s.reserved_bytes == 20 * KiB
    assert s.allocated_bytes == 3 * KiB
    assert s.peak_allocated_bytes == 7 * KiB
    assert s.free_bytes == 17 * KiB
    assert s.largest_free_block == 16 * KiB
    assert s.fragmentation == pytest.approx(1 - 16 / 17)
    assert (s.chunks, s.live_allocations, s.free_blocks) == (2, 2, 2)
    assert (s.total_allocations, s.total_frees, s.failed_allocations) == (3, 1, 0)
    sa.reset_peak()
    assert sa.stats().peak_allocated_bytes == 3 * KiB


# -- invariants, by hypothesis ------------------------------------------------------------------

sizes = st.one_of(st.integers(0, 4 * KiB), st.integers(0, 256 * KiB), st.sampled_from([256, 512, 1024]))


class SubAllocatorMachine(RuleBasedStateMachine):
    """Random add_chunk / allocate / free / remove_chunk against a plain model of the bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.sa = SubAllocator()
        self.chunks: dict[int, int] = {}
        self.live: dict[int, int] = {}  # address -> aligned size
        self.next_base = BASE
        self.peak = 0
        self.n_alloc = self.n_free = self.n_failed = 0

    @rule(units=st.integers(1, 1024), gap=st.booleans())
    def add_chunk(self, units: int, gap: bool) -> None:
        size = units * ALIGNMENT
        base = self.next_base + (ALIGNMENT * 3 if gap else 0)  # contiguous chunks too
        self.sa.add_chunk(base, size)
        self.chunks[base] = size
        self.next_base = base + size

    @rule(nbytes=sizes)
    def allocate(self, nbytes: int) -> None:
        want = aligned(nbytes)
        before = dict(free_blocks(self.sa))
        fitting = [s for s in before.values() if s >= want]
        addr = self.sa.allocate(nbytes)
        if addr is None:
            assert not fitting  # None only when no free block fits
            self.n_failed += 1
            return
        assert before.get(addr) == min(fitting)  # best fit, block start
        assert addr % ALIGNMENT == 0
        self.live[addr] = want
        self.n_alloc += 1
        self.peak = max(self.peak, sum(self.live.values()))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        addr = data.draw(st.sampled_from(sorted(self.live)))
        self.sa.free(addr)
        del self.live[addr]
        self.n_free += 1
        with pytest.raises(InvalidAddress):
            self.sa.free(addr)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_deferred_then_take_some_back(self, data: st.DataObject) -> None:
        """Blocks freed without merging, some taken back whole at their address (no split), then
        an allocation: the free lists end as a twin's that freed eagerly and took the same back."""
        twin = SubAllocator()
        for base, size in self.chunks.items():
            twin.add_chunk(base, size)
        for address, size in self.live.items():
            assert twin.allocate_at(address, size) == address
        freed = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, unique=True))
        for address in freed:
            self.sa.free_deferred(address)
            twin.free(address)
            with pytest.raises(DoubleFree):
                self.sa.free(address)
        back = data.draw(st.lists(st.sampled_from(freed), unique=True))
        for address in back:
            assert self.sa.allocate_at(address, self.live[address]) == address
            assert twin.allocate_at(address, self.live[address]) == address
        for address in set(freed) - set(back):
            del self.live[address]
        self.n_free += len(freed)
        self.n_alloc += len(back)
        assert self.sa.allocated_bytes == sum(self.live.values())  # counted free at once
        assert list(self.sa.blocks()) == list(twin.blocks())

    @precondition(lambda self: self.sa.releasable_chunks())
    @rule(data=st.data())
    def remove_chunk(self, data: st.DataObject) -> None:
        base, size = data.draw(st.sampled_from(self.sa.releasable_chunks()))
        assert not any(base <= a < base + size for a in self.live)
        assert self.sa.remove_chunk(base) == size
        del self.chunks[base]

    @invariant()
    def live_blocks_are_disjoint_and_inside_chunks(self) -> None:
        spans = sorted((a, a + s) for a, s in self.live.items())
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start
        for a, s in self.live.items():
            base = self.sa.chunk_of(a)
            assert base is not None and a + s <= base + self.chunks[base]

    @invariant()
    def blocks_tile_chunks_and_free_neighbours_are_merged(self) -> None:
        blocks = list(self.sa.blocks())
        assert {(b.address, b.size) for b in blocks if b.used} == set(self.live.items())
        for base, size in self.chunks.items():
            mine = [b for b in blocks if b.chunk == base]
            assert sum(b.size for b in mine) == size
            for x, y in zip(mine, mine[1:], strict=False):
                assert x.used or y.used  # coalesced: never two free blocks side by side

    @invariant()
    def stats_are_exact(self) -> None:
        s = self.sa.stats()
        reserved = sum(self.chunks.values())
        allocated = sum(self.live.values())
        frees = [size for _, size in free_blocks(self.sa)]
        largest = max(frees, default=0)
        assert s.reserved_bytes == reserved
        assert s.allocated_bytes == allocated
        assert s.free_bytes == reserved - allocated == sum(frees)
        assert s.peak_allocated_bytes == self.peak
        assert s.largest_free_block == largest
        assert s.fragmentation == (1 - largest / s.free_bytes if s.free_bytes else 0.0)
        assert (s.chunks, s.live_allocations, s.free_blocks) == (
            len(self.chunks),
            len(self.live),
            len(frees),
        )
        assert (s.total_allocations, s.total_frees, s.failed_allocations) == (
            self.n_alloc,
            self.n_free,
            self.n_failed,
        )

    def teardown(self) -> None:
        for addr in list(self.live):
            self.sa.free(addr)
        # everything coalesced: each chunk is one free block, and every chunk can go back
        assert free_blocks(self.sa) == sorted(self.chunks.items())
        assert self.sa.releasable_chunks() == sorted(self.chunks.items())
        assert sorted(self.sa.trim_plan(0)) == sorted(self.chunks)
        for base in self.sa.trim_plan(0):
            self.sa.remove_chunk(base)
        assert self.sa.reserved_bytes == 0 and self.sa.stats().free_blocks == 0


SubAllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSubAllocatorMachine = SubAllocatorMachine.TestCase


def test_long_random_workload_frees_back_to_one_block_per_chunk() -> None:
    """A fixed-seed workload far longer than the state machine's runs; the end state is exact."""
    rng = random.Random(3)
    sa = SubAllocator()
    chunk_sizes = [MiB, 4 * MiB, 256 * KiB, 2 * MiB]
    for i, size in enumerate(chunk_sizes):
        sa.add_chunk(BASE + i * 8 * MiB, size)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.5:
            addr = rng.choice(list(live))
            sa.free(addr)
            del live[addr]
        else:
            n = rng.choice([rng.randrange(1, 4 * KiB), rng.randrange(1, 512 * KiB)])
            addr = sa.allocate(n)
            if addr is not None:
                live[addr] = aligned(n)
    assert sa.allocated_bytes == sum(live.values())
    for addr in live:
        sa.free(addr)
    assert sa.releasable_chunks() == [(BASE + i * 8 * MiB, s) for i, s in enumerate(chunk_sizes)]
