"""A daemon thread that calls a function at a fixed period: the only thread shape the pool's shells
need (the scaler, the background recycler, the weight keep-alive sweep)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["PeriodicThread"]


class PeriodicThread:
    """Calls `fn()` every `period_s` seconds (a late call is not made up for) until `stop`.

    An exception in `fn` is counted and kept in `last_error`; the thread goes on, so one failed
    iteration never stops the pool from scaling.

    With `idle` and `idle_period_s`: after a call, if `idle()` says there is nothing to do, the next
    call comes `idle_period_s` later instead (an idle proxy does not wake hundreds of times a second:
    each wakeup costs a context switch and its process's GIL), or at once on `wake()`.
    """

    def __init__(
        self,
        name: str,
        period_s: float,
        fn: Callable[[], object],
        *,
        idle: Callable[[], bool] | None = None,
        idle_period_s: float | None = None,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period must be > 0, got {period_s}")
        if idle_period_s is not None and not idle_period_s >= period_s:
            raise ValueError(f"idle_period_s must be >= period_s ({period_s}), got {idle_period_s}")
        self.name = name
        self.period_s = period_s
        self.fn = fn
        self.idle = idle if idle_period_s is not None else None
        self.idle_period_s = idle_period_s
        self.iterations = 0
        self.idle_iterations = 0  # calls after which `idle()` said there was nothing to do
        self.errors = 0
        self.last_error: BaseException | None = None
        self._stopping = False
        self._signal = threading.Event()  # set by `stop` and `wake`
        self._thread: threading.Thread | None = None

    def start(self) -> PeriodicThread:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        return self

    def wake(self) -> None:
        """Make the next call now (during a call: right after it), e.g. when work arrives while the
        thread sleeps its idle period."""
        if not self._signal.is_set():
            self._signal.set()

    def _loop(self) -> None:
        next_at = time.monotonic()
        signal = self._signal
        while True:
            delay = next_at - time.monotonic()
            if delay > 0 and signal.wait(delay):
                next_at = time.monotonic()  # woken: the period counts from now
            if self._stopping:
                return
            signal.clear()
            idle = False
            try:
                self.fn()
                idle = self.idle is not None and self.idle()
            except Exception as exc:  # keep going: see the class docstring
                self.errors += 1
                self.last_error = exc
            self.iterations += 1
            now = time.monotonic()
            if idle and self.idle_period_s is not None:
                self.idle_iterations += 1
                next_at = now + self.idle_period_s
            else:
                next_at = max(next_at + self.period_s, now)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._signal.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def cpu_seconds(self) -> float:
        """CPU time the thread has used so far (Linux; 0.0 where per-thread clocks are unavailable)."""
        thread = self._thread
        if thread is None or thread.ident is None or not thread.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):
            return 0.0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
