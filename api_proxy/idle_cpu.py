"""CPU an instance uses while it serves nothing: bounded.

A handler may leave a thread running after it returns; the instance stays warm and that thread goes
on between invocations, taking the host's CPU from the proxy and the other functions, with no
invocation's timeout to end it. The proxy samples each instance's CPU time about once a second
(`cpu_seconds`: its threads', from /proc) and follows what it uses over spans in which it ran no
invocation (`IdleCpu.observe`): a span burning at least `BURN_RATE` of a core adds its CPU seconds,
a calmer one starts the count again. An instance whose count passes `IDLE_CPU_BUDGET_S` (a couple of
seconds of sustained burning) is stopped and the proxy logs why; the function's next request gets a
fresh instance. A warm instance waiting for work uses about 3 ms of CPU a second (its channel's
wait), far below the rate, however long it stays warm. Processes a handler started are not counted
here (their CPU is not their parent's); they end with their instance (`template.py`).

Pure policy (`IdleCpu`) and a thin reader (`cpu_seconds`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from streambox.device.procfs import stat_fields

IDLE_CPU_BUDGET_S = 2.0  # CPU seconds of sustained burning an idle instance may use
BURN_RATE = 0.5  # a span counts as burning at this share of a core or more
IDLE_CPU_CHECK_S = 1.0  # how often the proxy samples
_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads); None if it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


@dataclass
class IdleCpu:
    """One instance's CPU samples: how much it has been burning while idle (module doc)."""

    used_s: float = 0.0
    _last: tuple[float, float, int, bool] | None = None  # the last sample: CPU s, time, dispatched, idle

    def observe(self, cpu_s: float, now: float, dispatched: int, idle: bool) -> float:
        """A sample at `now`: its CPU seconds, how many invocations it was sent so far, whether it is
        idle. A span counts when the instance was idle at both ends and was sent nothing in between:
        burning (`BURN_RATE` of a core or more) it adds its CPU seconds, else the count restarts.
        Returns the count."""
        last, self._last = self._last, (cpu_s, now, dispatched, idle)
        if last is None or not (idle and last[3] and dispatched == last[2]) or now <= last[1]:
            return self.used_s
        used = max(0.0, cpu_s - last[0])
        self.used_s = self.used_s + used if used >= BURN_RATE * (now - last[1]) else 0.0
        return self.used_s

    def over_budget(self) -> bool:
        return self.used_s > IDLE_CPU_BUDGET_S
