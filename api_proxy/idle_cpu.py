"""CPU an instance uses while it serves nothing: bounded.

A handler may leave a thread (or a process) running after it returns; the instance stays warm and
that work goes on between invocations, taking the host's CPU from the proxy and the other functions,
with no invocation's timeout to end it. The proxy samples each instance's CPU time about once a
second (`cpu_seconds`, from /proc) and counts what it used over spans in which it ran no invocation
(`IdleCpu.observe`). An instance whose idle CPU passes `IDLE_CPU_BUDGET_S` is stopped (its process,
with whatever its handler left running, ends; the template kills what it started) and the proxy
logs why; the function's next request gets a fresh instance. A warm instance waiting for work uses
next to no CPU, so the budget only meets work a handler left behind.

Pure policy (`IdleCpu`) and a thin reader (`cpu_seconds`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from streambox.device.procfs import stat_fields

IDLE_CPU_BUDGET_S = 2.0  # CPU seconds an instance may use while idle, summed over its idle spans
IDLE_CPU_CHECK_S = 1.0  # how often the proxy samples
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads); None if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


@dataclass
class IdleCpu:
    """One instance's CPU samples: how much it used in spans with no invocation."""

    used_s: float = 0.0
    _last: tuple[float, int, bool] | None = None  # the last sample: CPU seconds, dispatched, idle

    def observe(self, cpu_s: float, dispatched: int, idle: bool) -> float:
        """A sample: its CPU seconds, how many invocations it was sent so far, whether it is idle now.
        A span counts when the instance was idle at both ends and was sent nothing in between.
        Returns the idle CPU seconds so far."""
        last, self._last = self._last, (cpu_s, dispatched, idle)
        if last is not None and idle and last[2] and dispatched == last[1]:
            self.used_s += max(0.0, cpu_s - last[0])
        return self.used_s

    def over_budget(self) -> bool:
        return self.used_s > IDLE_CPU_BUDGET_S
