"""The pure kernel placement policy of timed mode (`gpu_schedule.place_kernel`)."""

from __future__ import annotations

import random

import pytest

from streambox.device.gpu_schedule import (
    NEAR_KERNELS,
    Blocked,
    Placed,
    place_kernel,
    place_kernel_near,
    units_in_use,
)


# -- the reference: the search step by step, as the module describes it ---------------------------
def _min_free(own: list[Placed], start: float, end: float, capacity: int) -> int:
    """The fewest units free at any instant of [start, end): at `start` and at each own start."""
    points = [start] + [s for s, _, _ in own if start < s < end]
    return min(capacity - units_in_use(own, p) for p in points)


def _units_that_fit(own: list[Placed], start: float, unit_seconds: float, units: int, capacity: int):
    """(units, end): the most units, at most `units`, free all through the run; 0 when none are."""
    while True:
        end = start + unit_seconds / units
        fits = _min_free(own, start, end, capacity)
        if fits >= units:
            return units, end
        if fits < 1:
            return 0, end
        units = fits


def reference_place_kernel(
    ready: float, duration: float, full: int, want: int, capacity: int, own: list[Placed],
    blocked: list[Blocked],
) -> Placed:
    start = ready
    for _ in range(10_000):
        for b0, b1 in blocked:
            if b0 <= start < b1:
                start = b1
        if any(b0 <= start < b1 for b0, b1 in blocked):
            continue
        free = capacity - units_in_use(own, start)
        if free < 1:
            start = min(e for s, e, _ in own if s <= start < e)
            continue
        units, end = _units_that_fit(own, start, duration * full, min(want, free), capacity)
        if units == 0:
            start = min(e for s, e, _ in own if start < e and s < start + duration * full)
            continue
        clash = [b for b in blocked if start < b[0] < end]
        if clash:
            start = min(b1 for b0, b1 in clash)
            continue
        return start, end, units
    raise AssertionError("the reference found no placement")


def _random_backlog(rng: random.Random, capacity: int, kernels: int) -> tuple[list[Placed], float]:
    """A context's backlog: overlapping kernels, sorted by end; and the time the last one starts."""
    own, t = [], 0.0
    for _ in range(kernels):
        start = t + rng.uniform(-2e-5, 3e-5)
        length = rng.choice([0.0, rng.uniform(1e-6, 1e-4)])
        own.append((max(0.0, start), max(0.0, start) + length, rng.randint(1, capacity)))
        t = max(t, start)
    own.sort(key=lambda k: k[1])
    return own, t


def test_an_idle_gpu_starts_the_kernel_at_once_with_every_unit_it_wants():
    assert place_kernel(1.0, 0.5, full=80, want=80, capacity=80, own=[]) == (1.0, 1.5, 80)


def test_a_cap_stretches_the_kernel_by_the_units_it_lacks():
    start, end, units = place_kernel(0.0, 1.0, full=80, want=20, capacity=80, own=[])
    assert (start, units) == (0.0, 20) and end == pytest.approx(4.0)


def test_kernels_of_one_context_share_its_units():
    own = [(0.0, 1.0, 60)]
    # 20 units are free: the kernel starts at once on them and takes 4x as long ...
    assert place_kernel(0.0, 1.0, full=80, want=80, capacity=80, own=own) == (0.0, 4.0, 20)
    # ... and with every unit held it waits for the first own kernel to end
    assert place_kernel(0.0, 1.0, full=80, want=80, capacity=80, own=[(0.0, 1.0, 80)]) == (1.0, 2.0, 80)


def test_a_later_own_kernel_limits_the_units_over_the_whole_run():
    own = [(0.5, 10.0, 60)]  # takes 60 units from 0.5 on
    start, end, units = place_kernel(0.0, 1.0, full=80, want=80, capacity=80, own=own)
    assert (start, units) == (0.0, 20) and end == pytest.approx(4.0)
    assert units_in_use(own + [(start, end, units)], 1.0) == 80


def test_another_contexts_interval_is_never_overlapped():
    blocked = [(0.0, 2.0), (2.5, 3.0)]
    # does not fit into the 0.5 s gap: goes after the second interval
    assert place_kernel(0.0, 1.0, full=80, want=80, capacity=80, own=[], blocked=blocked) == (3.0, 4.0, 80)
    # fits into it
    assert place_kernel(0.0, 0.25, full=80, want=80, capacity=80, own=[], blocked=blocked) == (2.0, 2.25, 80)


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="wants 90 units of 80"):
        place_kernel(0.0, 1.0, full=80, want=90, capacity=80, own=[])
    with pytest.raises(ValueError, match="negative"):
        place_kernel(0.0, -1.0, full=80, want=80, capacity=80, own=[])


def test_an_idle_gpu_is_placed_as_the_search_would_place_it():
    """The shortcut for a context with nothing placed and nothing blocking gives what the search gives."""
    rng = random.Random(7)
    for _ in range(500):
        ready, duration = rng.uniform(0, 10), rng.choice([0.0, rng.uniform(1e-6, 1e-2)])
        capacity = rng.randint(1, 128)
        full, want = rng.randint(1, 160), rng.randint(1, capacity)
        past = [(-2.0, -1.0)]  # blocks nothing, but makes place_kernel search
        assert place_kernel(ready, duration, full, want, capacity, []) == place_kernel(
            ready, duration, full, want, capacity, [], past
        )


def test_the_near_search_places_as_the_full_search_behind_a_long_backlog():
    """`place_kernel_near` looks at the earliest-ending own kernels first; it must give what
    `place_kernel` gives on the whole backlog, whether or not the shortcut is taken."""
    rng = random.Random(11)
    shortcuts = 0
    for _ in range(400):
        capacity = rng.choice([8, 80])
        own, t = _random_backlog(rng, capacity, rng.randint(0, 120))
        longest = max((e - s for s, e, _ in own), default=0.0)
        blocked = [] if rng.random() < 0.5 else [(rng.uniform(0, t + 1e-4), rng.uniform(0, t + 2e-4))]
        blocked = [(b0, b1) for b0, b1 in blocked if b1 > b0]
        ready = rng.uniform(0, t + 1e-4)
        duration = rng.choice([0.0, rng.uniform(1e-7, 1e-5), rng.uniform(1e-5, 1e-3)])
        full, want = rng.randint(1, 2 * capacity), rng.randint(1, capacity)
        full = min(full, capacity)
        expected = place_kernel(ready, duration, full, want, capacity, own, blocked)
        near_placed = place_kernel_near(longest, ready, duration, full, want, capacity, own, blocked)
        assert near_placed == expected
        near = own[:NEAR_KERNELS]
        if len(own) > NEAR_KERNELS and expected[0] + duration * full < near[-1][1] - longest:
            shortcuts += 1
    assert shortcuts > 20  # the shortcut was taken often enough to be tested


def test_the_search_places_as_the_reference_does():
    """`place_kernel` runs the search's steps inline (once per timed kernel); the reference above runs
    them as the module describes them. Same placement, to the bit, over random backlogs and blocks."""
    rng = random.Random(23)
    waited = shrunk = 0
    for _ in range(3000):
        capacity = rng.choice([1, 8, 80])
        own, t = _random_backlog(rng, capacity, rng.randint(0, 12))
        starts = [rng.uniform(0, t + 1e-4) for _ in range(rng.randint(0, 3))]
        blocked = [(b0, b0 + rng.uniform(0, 5e-5)) for b0 in starts]
        ready = rng.uniform(0, t + 1e-4)
        duration = rng.choice([0.0, rng.uniform(1e-7, 1e-5), rng.uniform(1e-5, 1e-3)])
        full, want = rng.randint(1, capacity), rng.randint(1, capacity)
        expected = reference_place_kernel(ready, duration, full, want, capacity, own, blocked)
        assert place_kernel(ready, duration, full, want, capacity, own, blocked) == expected
        waited += expected[0] > ready
        shrunk += expected[2] < want
    assert waited > 300 and shrunk > 300  # the search's other branches were taken, not only the first
