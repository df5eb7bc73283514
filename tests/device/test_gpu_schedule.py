"""The pure kernel placement policy of timed mode (`gpu_schedule.place_kernel`)."""

from __future__ import annotations

import random

import pytest

from streambox.device.gpu_schedule import place_kernel, units_in_use


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
