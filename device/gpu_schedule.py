"""Where a kernel goes on a shared GPU in timed mode: a pure placement policy (no threads, no clocks).

The GPU's compute units are one pool. A context's kernels share its units (all of them, or its MPS
share); kernels of *other* contexts either block the interval entirely (time-slicing: contexts without
MPS never overlap another context) or do not matter (two MPS clients run side by side, each within
its own share). `place_kernel` returns the earliest start at or after `ready` where the kernel fits,
how many units it gets there, and its end:

- it asks for `want` units (`min(blocks, cu_cap, units of the context)`); its duration is given at
  `full` units (`min(blocks, compute units of the GPU)`), so with `u` units it takes
  `duration * full / u` (fewer units: more waves of thread blocks);
- at a start time it takes what is free of its context's units, at least one; when nothing is free
  it waits for the next own kernel to end;
- it never overlaps a blocked interval (a kernel is not preempted): when one starts before the kernel
  would end, the kernel starts after that interval instead.
"""

from __future__ import annotations

from collections.abc import Sequence

#: (start, end, units) of one kernel already placed in this context.
Placed = tuple[float, float, int]
#: (start, end) when another context holds the GPU.
Blocked = tuple[float, float]

_MAX_STEPS = 10_000


def units_in_use(own: Sequence[Placed], at: float) -> int:
    """Units this context's kernels hold at time `at`."""
    return sum(u for s, e, u in own if s <= at < e)


def _is_blocked(at: float, blocked: Sequence[Blocked]) -> bool:
    """Whether another context holds the GPU at time `at`."""
    return any(b0 <= at < b1 for b0, b1 in blocked)


def _past_blocked(start: float, blocked: Sequence[Blocked]) -> float:
    """`start` moved to the end of each blocked interval it falls in, in one pass over `blocked`."""
    for b0, b1 in blocked:
        if b0 <= start < b1:
            start = b1
    return start


def _units_that_fit(
    own: Sequence[Placed], start: float, unit_seconds: float, units: int, free: int, capacity: int
) -> tuple[int, float]:
    """(units, end): the most units, at most `units`, free all through a run from `start` that takes
    `unit_seconds / units` (`free` of them at `start`), checked at each own start within the run; 0
    units when some own kernel leaves none free on the way."""
    while True:
        end = start + unit_seconds / units
        fits = free
        for s, _, _ in own:
            if start < s < end:
                at = capacity - units_in_use(own, s)
                if at < fits:
                    fits = at
        if fits >= units:
            return units, end
        if fits < 1:
            return 0, end
        units = fits


def place_kernel(
    ready: float,
    duration: float,
    full: int,
    want: int,
    capacity: int,
    own: Sequence[Placed],
    blocked: Sequence[Blocked] = (),
) -> Placed:
    """(start, end, units) of a kernel that may start at `ready` (see the module). Called once per
    timed kernel, so the usage at a start is summed inline (`tests/device/test_gpu_schedule.py`
    holds the search step by step, the reference this agrees with)."""
    if duration < 0:
        raise ValueError(f"negative kernel duration: {duration}")
    if not 1 <= want <= capacity or full < 1:
        raise ValueError(f"kernel wants {want} units of {capacity} (full occupancy {full})")
    unit_seconds = duration * full  # the kernel's length on one unit
    if not blocked and not own:  # the common case, in one step (what the search finds)
        return ready, ready + unit_seconds / want, want
    start = ready
    for _ in range(_MAX_STEPS):
        if blocked:
            start = _past_blocked(start, blocked)
            if _is_blocked(start, blocked):
                continue
        free = capacity
        for s, e, u in own:  # `units_in_use`, inline
            if s <= start < e:
                free -= u
        if free < 1:  # nothing free: start when the first own kernel holding units ends
            start = min(e for s, e, _ in own if s <= start < e)
            continue
        units, end = _units_that_fit(own, start, unit_seconds, want if want < free else free, free, capacity)
        if units == 0:  # an own kernel takes the rest later on: start when the first one ends
            start = min(e for s, e, _ in own if start < e and s < start + unit_seconds)
            continue
        clash = [b1 for b0, b1 in blocked if start < b0 < end] if blocked else None
        if clash:  # another context's interval begins before the kernel would end: after it
            start = min(clash)
            continue
        return start, end, units
    raise RuntimeError(f"no placement found for a kernel ready at {ready} after {_MAX_STEPS} steps")


#: Own kernels `place_kernel_near` looks at first (the earliest-ending ones).
NEAR_KERNELS = 32


def place_kernel_near(
    longest: float,
    ready: float,
    duration: float,
    full: int,
    want: int,
    capacity: int,
    own: Sequence[Placed],
    blocked: Sequence[Blocked] = (),
) -> Placed:
    """`place_kernel(ready, duration, full, want, capacity, own, blocked)`, same result, at a cost
    that does not grow with a long backlog of own kernels.

    `own` must be sorted by end, and no own kernel may last longer than `longest` seconds. The search
    first runs on the `NEAR_KERNELS` earliest-ending own kernels: every later one ends at or after the
    last of those, so it starts at or after `horizon` (that end less `longest`). Every instant the
    search reads lies before its final start plus `duration * full` (the longest the kernel can take,
    on one unit), so when that is before `horizon` no later kernel could have changed a step: the
    result is the full search's. Otherwise the full search runs."""
    if len(own) <= NEAR_KERNELS:
        return place_kernel(ready, duration, full, want, capacity, own, blocked)
    near = own[:NEAR_KERNELS]
    horizon = near[-1][1] - longest
    try:
        placed = place_kernel(ready, duration, full, want, capacity, near, blocked)
    except RuntimeError:  # no placement within the steps: the full search decides
        return place_kernel(ready, duration, full, want, capacity, own, blocked)
    if placed[0] + duration * full < horizon:
        return placed
    return place_kernel(ready, duration, full, want, capacity, own, blocked)
