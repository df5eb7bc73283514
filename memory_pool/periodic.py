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
    """

    def __init__(self, name: str, period_s: float, fn: Callable[[], object]) -> None:
        if not period_s > 0:
            raise ValueError(f"period must be > 0, got {period_s}")
        self.name = name
        self.period_s = period_s
        self.fn = fn
        self.iterations = 0
        self.errors = 0
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PeriodicThread:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        next_at = time.monotonic()
        while True:
            delay = next_at - time.monotonic()
            if self._stop.wait(max(0.0, delay)):
                return
            try:
                self.fn()
            except Exception as exc:  # keep going: see the class docstring
                self.errors += 1
                self.last_error = exc
            self.iterations += 1
            next_at = max(next_at + self.period_s, time.monotonic())

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
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
