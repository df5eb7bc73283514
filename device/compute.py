"""Compute-unit accounting of the emulated device.

A kernel occupies `min(blocks, cu_cap or CUs, CUs)` compute units while it runs. Kernels of different
streams run concurrently while their units fit into the device; a kernel whose units are not free waits
(first come, first served), as thread blocks wait for free SMs. This is what makes the kernel
compiler's CU cap matter: two capped kernels overlap, two uncapped ones serialise.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

#: Timed kernels `ComputeUnits.account` keeps pending before it folds them into the statistics.
DEFER_LIMIT = 1024


def units_for(blocks: int, cu_cap: int | None, compute_units: int) -> int:
    """Compute units a kernel of `blocks` thread blocks occupies under an optional cap."""
    if blocks < 1:
        raise ValueError(f"a kernel needs at least one block, got {blocks}")
    if cu_cap is not None and cu_cap < 1:
        raise ValueError(f"cu_cap must be at least 1, got {cu_cap}")
    return min(blocks, cu_cap if cu_cap is not None else compute_units, compute_units)


@dataclass(frozen=True)
class KernelStats:
    """One kernel name's launches: how many, the most CUs one used, wall seconds and CU-seconds."""

    name: str
    launches: int
    compute_units: int
    busy_seconds: float
    cu_seconds: float
    errors: int


@dataclass(frozen=True)
class ComputeStats:
    compute_units: int  # capacity of the device
    in_use: int  # CUs occupied right now
    peak_concurrent_cus: int
    busy_cu_seconds: float
    kernels: dict[str, KernelStats] = field(default_factory=dict)


class ComputeUnits:
    """FIFO admission of kernels to the device's compute units, with statistics. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = capacity
        self._peak = 0
        self._busy_cu_seconds = 0.0
        self._waiting: deque[object] = deque()
        self._kernels: dict[str, list[float]] = {}  # name -> [launches, max cus, seconds, cu_s, errors]
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        # Timed kernels counted by `account`, (units, name, seconds), folded into the statistics in
        # batches (`_fold_locked`): one C-level append per kernel instead of a lock and five updates.
        self._deferred: deque[tuple[int, str, float]] = deque()

    def acquire(self, units: int) -> None:
        ticket = object()
        with self._cond:
            self._waiting.append(ticket)
            while self._waiting[0] is not ticket or self._free < units:
                self._cond.wait()
            self._waiting.popleft()
            self._free -= units
            self._peak = max(self._peak, self.capacity - self._free)
            self._cond.notify_all()

    def release(self, units: int, name: str, seconds: float, failed: bool = False) -> None:
        with self._cond:
            self._free += units
            self._account(units, name, seconds, failed)
            self._cond.notify_all()

    def account(self, units: int, name: str, seconds: float) -> None:
        """Count a kernel placed in modelled time (timed mode: no admission, no waiting). Deferred:
        the statistics see it at the next `stats`, or once `DEFER_LIMIT` kernels are pending."""
        deferred = self._deferred
        deferred.append((units, name, seconds))  # deque.append is atomic: no lock here
        if len(deferred) >= DEFER_LIMIT:
            with self._mutex:
                self._fold_locked()

    def account_many(self, kernels: list[tuple[int, str, float]]) -> None:
        """`account(units, name, seconds)` for each of `kernels`, in one step (a stream's segment)."""
        deferred = self._deferred
        deferred.extend(kernels)  # deque.extend of a list: atomic under the GIL, as append
        if len(deferred) >= DEFER_LIMIT:
            with self._mutex:
                self._fold_locked()

    def _fold_locked(self) -> None:
        """Fold the deferred timed kernels into the statistics. Caller holds the lock."""
        deferred, kernels = self._deferred, self._kernels
        seconds_total, peak = self._busy_cu_seconds, self._peak
        while deferred:
            try:
                units, name, seconds = deferred.popleft()
            except IndexError:  # pragma: no cover - only this method pops, under the lock
                break
            if units > peak:
                peak = units
            seconds_total += units * seconds
            entry = kernels.get(name)
            if entry is None:
                entry = kernels[name] = [0, 0, 0.0, 0.0, 0]
            entry[0] += 1
            if units > entry[1]:
                entry[1] = units
            entry[2] += seconds
            entry[3] += units * seconds
        self._busy_cu_seconds, self._peak = seconds_total, peak

    def _account(self, units: int, name: str, seconds: float, failed: bool) -> None:
        """Caller holds the lock."""
        self._busy_cu_seconds += units * seconds
        entry = self._kernels.setdefault(name, [0, 0, 0.0, 0.0, 0])
        entry[0] += 1
        entry[1] = max(entry[1], units)
        entry[2] += seconds
        entry[3] += units * seconds
        entry[4] += int(failed)

    def stats(self) -> ComputeStats:
        with self._cond:
            self._fold_locked()
            kernels = {
                name: KernelStats(name, int(e[0]), int(e[1]), e[2], e[3], int(e[4]))
                for name, e in self._kernels.items()
            }
            return ComputeStats(
                self.capacity, self.capacity - self._free, self._peak, self._busy_cu_seconds, kernels
            )

    def reset_stats(self) -> None:
        with self._cond:
            self._fold_locked()
            self._peak = self.capacity - self._free
            self._busy_cu_seconds = 0.0
            self._kernels.clear()
