"""The access schedule decides per kernel what the mapping table's counting decides per access."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from streambox.memory_pool.access_schedule import AccessSchedule
from streambox.memory_pool.mapping_table import MappingTable, RecycledAccess


def test_first_and_last_access_of_a_small_plan() -> None:
    # rows: 0 (100 B, 2 accesses), 1 (200 B, 1), 2 (300 B, never by count), 3 (50 B, 2: twice in one kernel)
    schedule = AccessSchedule.of([100, 200, 300, 50], [2, 1, None, 2], [[0], [0, 1], [2, 3, 3]])
    assert schedule is not None
    assert [(s.first, s.sizes, s.last) for s in schedule.steps] == [
        ((0,), (100,), ()),
        ((1,), (200,), (0, 1)),
        ((2, 3), (300, 50), (3,)),
    ]
    assert schedule.peak_bytes == 300 + 50  # 0 and 1 were recycled before row 2 and 3 came


def test_too_many_accesses_leave_the_plan_to_the_counting_path() -> None:
    assert AccessSchedule.of([100], [1], [[0], [0]]) is None
    assert AccessSchedule.of([100], [1], [[0], [0]], eager=False) is not None  # static: no recycling


def test_static_allocates_nothing_per_kernel_and_recycles_nothing() -> None:
    schedule = AccessSchedule.of([100, 200], [1, 1], [[0], [1]], lazy=False, eager=False)
    assert schedule is not None
    assert all(not s.first and not s.last for s in schedule.steps) and schedule.peak_bytes == 300


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 4096), min_size=n, max_size=n),
            st.lists(st.one_of(st.none(), st.integers(1, 4)), min_size=n, max_size=n),
            st.lists(st.lists(st.integers(0, n - 1), max_size=4), max_size=8),
        )
    )
)
def test_the_schedule_matches_the_tables_counting(case) -> None:
    """Random plans: per kernel, the rows the counting path allocates (in touch order) and recycles
    are the schedule's `first` and `last`, the peak is its `peak_bytes`, and where counting raises
    RecycledAccess the schedule declines."""
    sizes, expected, kernel_rows = case
    schedule = AccessSchedule.of(sizes, expected, kernel_rows)
    table = MappingTable()
    for row, (nbytes, want) in enumerate(zip(sizes, expected, strict=True)):
        table.register("f", "m", str(row), nbytes, want)
    entries = table.rows("f", "m", [str(r) for r in range(len(sizes))])
    addresses = iter(range(0x1000, 1 << 40, 0x1000))
    steps, peak = [], 0
    for rows in kernel_rows:
        untouched = {r for r, e in enumerate(entries) if e.accesses == 0}
        recycled = {r for r, e in enumerate(entries) if e.recycled}
        try:
            table.touch_recycling([entries[r] for r in rows], lambda _: next(addresses), [])
        except RecycledAccess:
            assert schedule is None
            return
        first = tuple(r for r in dict.fromkeys(rows) if r in untouched)
        last = sorted(r for r, e in enumerate(entries) if e.recycled and r not in recycled)
        steps.append((first, tuple(sizes[r] for r in first), last))
        peak = max(peak, table.touched_bytes)
    assert schedule is not None
    assert [(s.first, s.sizes, sorted(s.last)) for s in schedule.steps] == steps
    assert schedule.peak_bytes == peak
