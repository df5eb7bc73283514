"""What one run of a plan returns: its outputs, its `done` event and its statistics (per-kernel
device times when the run profiled)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from streambox.device import Event

from .device_tensor import DeviceTensor

__all__ = ["RunResult", "RunStats"]


@dataclass
class RunStats:
    kernels: int = 0
    peak_live_bytes: int = 0  # intermediates and outputs held at once by this run
    allocations: int = 0
    issue_seconds: float = 0.0  # host time spent issuing the plan
    # Per-kernel device time, filled when the run was asked to profile (events around each kernel).
    kernel_seconds: list[float] | None = None


@dataclass
class RunResult:
    outputs: dict[str, DeviceTensor]
    stats: RunStats
    done: Event  # completes when the last kernel has run: poll it instead of syncing the stream
    instance: Hashable = None
    _events: list[Event] = field(default_factory=list, repr=False)
    _timed: list[int] = field(default_factory=list, repr=False)  # plan index of each timed kernel
    _plan_kernels: int = 0

    def kernel_seconds(self) -> list[float]:
        """Device time of each compute kernel (profiling runs only); waits for the run to finish."""
        self.done.synchronize()
        return [a.elapsed_ms(b) / 1e3 for a, b in zip(self._events, self._events[1:], strict=False)]

    def plan_kernel_seconds(self) -> list[float]:
        """Device time of every kernel of the plan, 0.0 for view kernels (profiling runs only)."""
        seconds = [0.0] * self._plan_kernels
        for index, s in zip(self._timed, self.kernel_seconds(), strict=True):
            seconds[index] = s
        return seconds
