"""When each variable of a static plan is allocated and recycled, decided once per plan.

Fine-grained memory management takes a variable's memory at its first access and gives it back when
its access count reaches the profiled expected count (paper section 5.1). For a static plan both
moments are fixed by the plan alone: the kernel that first touches a variable, and the kernel whose
touch brings its count to the expected one. `AccessSchedule.of` replays the counting once, so a run
needs no per-access counting: per kernel it allocates `first` and recycles `last` (the mapping table
still holds every address; `MappingTable.place` and `retire` keep it true).

`of` returns None when the counts would raise `RecycledAccess` (a variable touched more often than
its expected count): such a plan runs through the table's counting path, which raises at the
offending access as before.

Pure: no threads, no device calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AccessSchedule", "KernelStep"]


@dataclass(frozen=True)
class KernelStep:
    """What one kernel does to the table: rows allocated before it (in touch order) and their bytes,
    rows recycled after it."""

    first: tuple[int, ...]
    sizes: tuple[int, ...]  # requested bytes of each row of `first`
    last: tuple[int, ...]


_NOTHING = KernelStep((), (), ())


@dataclass(frozen=True)
class AccessSchedule:
    """Per kernel of a plan, its `KernelStep`; `peak_bytes` is the most bytes live during a kernel."""

    steps: tuple[KernelStep, ...]
    peak_bytes: int

    @classmethod
    def of(
        cls,
        sizes: Sequence[int],
        expected: Sequence[int | None],
        kernel_rows: Sequence[Sequence[int]],
        *,
        lazy: bool = True,
        eager: bool = True,
    ) -> AccessSchedule | None:
        """`sizes[r]`, `expected[r]`: bytes and expected accesses (None: never by count) of row `r`;
        `kernel_rows[k]`: the rows kernel `k` touches, in order, repeats counted. `lazy=False`: every
        row is allocated before the run (nothing in `first`); `eager=False`: nothing is recycled by
        count (nothing in `last`). None when a row is touched past its expected count under `eager`."""
        if len(sizes) != len(expected):
            raise ValueError(f"{len(sizes)} sizes for {len(expected)} expected counts")
        counts = [0] * len(sizes)
        live = sum(sizes) if not lazy else 0
        peak = live
        steps = []
        for rows in kernel_rows:
            first: list[int] = []
            last: list[int] = []
            for row in rows:
                want = expected[row]
                if eager and want is not None and counts[row] >= want:
                    return None  # the counting path raises RecycledAccess here
                if counts[row] == 0 and lazy:
                    first.append(row)
                counts[row] += 1
                if eager and counts[row] == want:
                    last.append(row)
            step = _NOTHING
            if first or last:
                step = KernelStep(tuple(first), tuple(sizes[r] for r in first), tuple(last))
            live += sum(step.sizes)
            peak = max(peak, live)
            live -= sum(sizes[r] for r in last)
            steps.append(step)
        return cls(tuple(steps), peak)
