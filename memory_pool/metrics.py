"""Pool metrics: exact time averages, a bounded time series for plots, allocation latencies.

Three quantities are followed over time:

- `reserved`: device bytes the pool holds (its chunks): what the device (and the bill) sees;
- `allocated`: bytes of the pool's blocks in use, 256-byte aligned, including blocks whose
  stream-ordered free the stream has not reached yet;
- `demand`: the exact live demand: bytes requested by allocations that are live (not yet freed by
  their owner), unaligned. This is what an oracle pool with no chunks, no alignment and no
  stream-order delay would hold.

`update` is called by the pool on every change (under the pool's lock), once per kernel on the
executor's path, so it only queues the change: the queue is integrated in bulk (numpy) when it is
full or read, which costs a fraction of integrating each change as it comes. Time averages are exact
integrals of these step functions, not averages of samples; the series is a bounded record for plots
(at most one point per `series_interval_s`, plus the last one). Latencies are kept in bounded rings.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from operator import itemgetter
from pathlib import Path

import numpy as np

__all__ = ["LatencySummary", "MetricsSummary", "PoolMetrics", "Sample", "percentile"]

#: Changes queued before they are integrated: big enough that numpy's fixed cost per bulk integration
#: is small against the Python it replaces, small enough that the integration (about 0.3 ms, under the
#: pool's lock) is no long stall for an allocation waiting on that lock.
QUEUED_CHANGES = 512


@dataclass(frozen=True)
class Sample:
    """One point of the time series (`t` in seconds since the metrics window started)."""

    t: float
    reserved: int
    allocated: int
    demand: int


@dataclass(frozen=True)
class LatencySummary:
    count: int
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float


@dataclass(frozen=True)
class MetricsSummary:
    """Exact time averages and peaks over the window, and latency percentiles."""

    duration_s: float
    mean_reserved: float
    mean_allocated: float
    mean_demand: float
    peak_reserved: int
    peak_allocated: int
    peak_demand: int
    pool_over_demand: float  # mean_reserved / mean_demand (inf if no demand)
    alloc: LatencySummary
    free: LatencySummary

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """The `q`-quantile (0..1) by nearest rank of a non-empty list; nan for an empty one."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _latency(samples: deque[float]) -> LatencySummary:
    values = list(samples)
    us = [v * 1e6 for v in values]
    return LatencySummary(
        len(us), percentile(us, 0.5), percentile(us, 0.9), percentile(us, 0.99), max(us, default=math.nan)
    )


class PoolMetrics:
    """Time integrals, peaks, a bounded series and latency rings for one pool. The pool calls `update`
    and `record_*` under its own lock and passes that lock as `lock`, which the reads (`summary`,
    `series`, `to_csv`, `to_json`) and `reset` take: a read integrates the queued changes, so it
    must not run beside an `update` (`update` itself takes no lock: the pool holds it already)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        series_limit: int = 100_000,
        series_interval_s: float = 1e-3,
        latency_limit: int = 200_000,
        lock: threading.RLock | None = None,
    ) -> None:
        self._lock = lock if lock is not None else threading.RLock()
        self.clock = clock
        self.series_interval_s = series_interval_s
        self._series: deque[Sample] = deque(maxlen=series_limit)
        self._alloc_s: deque[float] = deque(maxlen=latency_limit)
        self._free_s: deque[float] = deque(maxlen=latency_limit)
        self._values = (0, 0, 0)
        self._changes: list[tuple[float, int, int, int]] = []  # queued by `update`, not integrated yet
        self._last = 0.0
        self.reset()

    def reset(self, now: float | None = None) -> None:
        """Start a new window at `now`, keeping the current values."""
        with self._lock:
            now = self.clock() if now is None else now
            self._integrate()
            self._start = self._last = now
            self._last_sample = -math.inf
            self._integrals = [0.0, 0.0, 0.0]
            self._peaks = list(self._values)
            self._series.clear()
            self._alloc_s.clear()
            self._free_s.clear()
            self._append(now)

    def update(self, now: float, reserved: int, allocated: int, demand: int) -> None:
        """The values changed at `now` (monotonic, on the metrics' clock)."""
        changes = self._changes
        changes.append((now, reserved, allocated, demand))
        if len(changes) >= QUEUED_CHANGES:
            self._integrate()

    def _integrate(self) -> None:
        """Fold the queued changes into the integrals, the peaks and the series, as `update` would
        have one by one: a change before the last one integrated (a clock that went back) adds no
        time, and the series takes a change once `series_interval_s` has passed since its last."""
        changes = self._changes
        if not changes:
            return
        self._changes = []
        table = np.array(changes, dtype=np.float64)  # byte counts < 2**53: exact
        reached = np.maximum.accumulate(np.concatenate(([self._last], table[:, 0])))
        held = np.vstack((np.array(self._values, dtype=np.float64), table[:-1, 1:]))
        added = np.diff(reached) @ held  # each value times how long it held
        self._integrals = [total + float(more) for total, more in zip(self._integrals, added, strict=True)]
        self._last = float(reached[-1])
        self._values = changes[-1][1:]
        tops = (max(map(itemgetter(column), changes)) for column in (1, 2, 3))  # ints, exact at any size
        self._peaks = [max(peak, top) for peak, top in zip(self._peaks, tops, strict=True)]
        last_sample, interval, start = self._last_sample, self.series_interval_s, self._start
        series = self._series
        for now, reserved, allocated, demand in changes:
            if now - last_sample >= interval:
                series.append(Sample(now - start, reserved, allocated, demand))
                last_sample = now
        self._last_sample = last_sample

    def _append(self, now: float) -> None:
        r, a, d = self._values
        self._series.append(Sample(now - self._start, r, a, d))
        self._last_sample = now

    def record_batch(
        self, now: float, reserved: int, allocated: int, demand: int, seconds: float, frees: int, allocs: int
    ) -> None:
        """`update(now, reserved, allocated, demand)`, then `frees` frees and `allocs` allocations that
        took `seconds` each, in one call (the pool's per-kernel `free_and_allocate`)."""
        changes = self._changes  # `update`, inlined: this is the executor's per-kernel call
        changes.append((now, reserved, allocated, demand))
        if len(changes) >= QUEUED_CHANGES:
            self._integrate()
        if frees:
            if frees == 1:
                self._free_s.append(seconds)
            else:
                self._free_s.extend(itertools.repeat(seconds, frees))
        if allocs:
            if allocs == 1:
                self._alloc_s.append(seconds)
            else:
                self._alloc_s.extend(itertools.repeat(seconds, allocs))

    def record_alloc(self, seconds: float, count: int = 1) -> None:
        """`count` allocations that took `seconds` each (a batch, amortised)."""
        if count == 1:
            self._alloc_s.append(seconds)
        else:
            self._alloc_s.extend(itertools.repeat(seconds, count))

    def record_free(self, seconds: float, count: int = 1) -> None:
        """`count` frees that took `seconds` each (a batch free, amortised)."""
        if count == 1:
            self._free_s.append(seconds)
        else:
            self._free_s.extend(itertools.repeat(seconds, count))

    # -- reading ----------------------------------------------------------------------------
    def summary(self, now: float | None = None) -> MetricsSummary:
        with self._lock:
            return self._summary(now)

    def _summary(self, now: float | None) -> MetricsSummary:
        now = self.clock() if now is None else now
        self._integrate()
        dt = max(0.0, now - self._last)
        r, a, d = self._values
        total = [self._integrals[0] + r * dt, self._integrals[1] + a * dt, self._integrals[2] + d * dt]
        duration = now - self._start
        means = [x / duration if duration > 0 else float(v) for x, v in zip(total, self._values, strict=True)]
        return MetricsSummary(
            duration_s=duration,
            mean_reserved=means[0],
            mean_allocated=means[1],
            mean_demand=means[2],
            peak_reserved=self._peaks[0],
            peak_allocated=self._peaks[1],
            peak_demand=self._peaks[2],
            pool_over_demand=means[0] / means[2] if means[2] > 0 else math.inf,
            alloc=_latency(self._alloc_s),
            free=_latency(self._free_s),
        )

    def series(self) -> list[Sample]:
        """The recorded points, oldest first, with the current values appended."""
        with self._lock:
            self._integrate()
            r, a, d = self._values
            points = list(self._series)
        now = self.clock()
        if not points or points[-1] != Sample(now - self._start, r, a, d):
            points.append(Sample(now - self._start, r, a, d))
        return points

    def to_csv(self, path: Path | str) -> Path:
        """Write the series as CSV: t_s, reserved_bytes, allocated_bytes, demand_bytes."""
        path = Path(path)
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["t_s", "reserved_bytes", "allocated_bytes", "demand_bytes"])
            for s in self.series():
                writer.writerow([f"{s.t:.6f}", s.reserved, s.allocated, s.demand])
        return path

    def to_json(self, path: Path | str | None = None) -> dict[str, object]:
        """The summary and the series as one JSON-able dict; written to `path` if given."""
        with self._lock:
            series, summary = self.series(), self.summary()
        data = {
            "summary": summary.to_dict(),
            "series": {
                "t_s": [s.t for s in series],
                "reserved_bytes": [s.reserved for s in series],
                "allocated_bytes": [s.allocated for s in series],
                "demand_bytes": [s.demand for s in series],
            },
        }
        if path is not None:
            Path(path).write_text(json.dumps(data))
        return data
