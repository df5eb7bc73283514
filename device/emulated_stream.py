"""Streams and events of the emulated device.

A stream is a FIFO of operations served by its own worker thread. Every operation gets a *ready time*
in the modelled timeline: `max(issue time, end of the stream's previous operation, end of the events
it waits on)`. Copies are handed to the runtime's copy engines with that ready time, so modelled
completion times chain exactly through a stream; kernels run for real and take real time.

When a copy is issued to an idle stream (nothing queued or running, no pending wait), the issuing
thread hands it to the engine at once, so copies issued by the host in some order reach the FIFO
engine in that order whatever the worker threads' scheduling; otherwise the worker hands it over
when the stream reaches it.

Errors (a failing kernel, a copy touching memory freed meanwhile) are recorded with the operation's
sequence number and raised, once, by the next `synchronize` of the stream or of an event recorded on
it after them. The stream keeps running.

In timed mode (virtual time) nothing on a stream sleeps but copies: a kernel's end is placed at issue
(`place_kernel`), events and pool frees take effect at their modelled time, and whoever waits sleeps
until that time. An operation issued to an idle stream is resolved at once on the issuing thread
(`inline`), so a run of kernels costs no thread hop; only work behind a copy in flight goes through
the worker.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .base import DeviceError, Event, Stream
from .copy_engine import CopyEngine, CopyJob, sleep_until

if TYPE_CHECKING:
    from .emulated import EmulatedRuntime

#: fn(ready) -> end: an operation's body, run on the worker with its modelled ready time.
OpFn = Callable[[float], float]

_thread_ids = itertools.count()


#: Guards a marker's switch to resolved against a waiter arriving (`Marker.resolve`/`wait_resolved`).
_MARKER_LOCK = threading.Lock()


class Marker:
    """What an event captured by one `record`: the stream position and, once `resolved`, the modelled
    time at which the work before it completes (in timed mode possibly still in the future).

    A threading.Event per marker cost 2.5 us per record (made and set), paid by every pool fence; in
    timed mode most markers resolve at once on the recording thread and nobody waits, so a waiter's
    event is made only by a thread that has to wait."""

    __slots__ = ("stream", "seq", "time", "resolved", "_waiter")

    def __init__(self, stream: EmulatedStream) -> None:
        self.stream = stream
        self.seq = 0
        self.time = 0.0
        self.resolved = False
        self._waiter: threading.Event | None = None

    def resolve(self, ready: float) -> float:
        """The stream reached the marker at modelled time `ready` (an operation's body: returns it)."""
        self.time = ready
        with _MARKER_LOCK:
            self.resolved = True
            waiter = self._waiter
        if waiter is not None:
            waiter.set()
        return ready

    def wait_resolved(self) -> None:
        """Block until the stream has reached the marker (its modelled time may still be ahead)."""
        if self.resolved:
            return
        with _MARKER_LOCK:
            if self.resolved:
                return
            if self._waiter is None:
                self._waiter = threading.Event()
            waiter = self._waiter
        waiter.wait()

    def complete(self) -> bool:
        return self.resolved and time.perf_counter() >= self.time

    def wait(self) -> None:
        self.wait_resolved()
        sleep_until(self.time)


class _Op:
    __slots__ = ("seq", "issued", "fn")

    def __init__(self, seq: int, issued: float, fn: OpFn | None) -> None:
        self.seq, self.issued, self.fn = seq, issued, fn


def _raise_errors(errors: list[BaseException]) -> None:
    if not errors:
        return
    first = errors[0]
    if len(errors) > 1:
        first.add_note(f"{len(errors) - 1} more error(s) on the same stream since the last synchronize:")
        for other in errors[1:]:
            first.add_note(f"  {type(other).__name__}: {other}")
    raise first


class EmulatedStream(Stream):
    def __init__(self, runtime: EmulatedRuntime, stream_id: int, priority: int = 0) -> None:
        self.id = stream_id
        self.priority = priority
        self.lane = f"stream:{stream_id}"
        self._runtime = runtime
        # One lock, two conditions: the worker waits for work (`_work`), callers wait for completions
        # (`_cond`), so an operation resolved inline does not wake the idle worker for nothing.
        lock = self._lock = threading.RLock()
        self._cond = threading.Condition(lock)
        self._work = threading.Condition(lock)
        self._queue: deque[_Op] = deque()
        self._busy = False
        self._issued = 0
        self._completed = 0
        self._cursor = 0.0  # modelled end of the last completed operation
        self._errors: list[tuple[int, BaseException]] = []
        self._destroyed = False
        self._timed = runtime.timed
        self.thread = threading.Thread(
            target=self._loop,
            name=f"streambox-emu-{runtime.name_tag}-s{stream_id}-{next(_thread_ids)}",
            daemon=True,
        )
        self.thread.start()

    def __repr__(self) -> str:
        return f"<EmulatedStream {self.id} of {self._runtime.name_tag} priority={self.priority}>"

    @property
    def runtime(self) -> EmulatedRuntime:
        return self._runtime

    # -- issuing ----------------------------------------------------------------------------
    def enqueue(
        self,
        fn: OpFn,
        *,
        marker: Marker | None = None,
        on_idle: Callable[[float], None] | None = None,
        inline: bool = False,
        at_once: Callable[[float], float | None] | None = None,
        issued_at: float | None = None,
    ) -> int:
        """Queue `fn(ready) -> end`; `on_idle(ready)` runs at once, here, if the stream is idle. In
        timed mode an `inline` operation on an idle stream runs here, at once (`fn` must not block),
        and so does `at_once(ready)` when it returns the operation's end (None: queue `fn` after all).
        `issued_at`: when the operation was issued, if not now (an operation whose issue took host
        time that its device side overlaps, a pageable copy's staging)."""
        with self._lock:
            if self._destroyed:
                raise DeviceError(f"stream {self.id} has been destroyed")
            self._issued = seq = self._issued + 1
            issued = time.perf_counter() if issued_at is None else issued_at
            if marker is not None:
                marker.seq = seq
            idle = not self._queue and not self._busy
            if idle and self._timed and (inline or at_once is not None):
                cursor = self._cursor
                place = fn if inline or at_once is None else at_once
                try:
                    end = place(issued if issued > cursor else cursor)
                    if end is not None and end > cursor:
                        self._cursor = end
                except BaseException as exc:
                    self._errors.append((seq, exc))
                    end = cursor
                if end is not None:
                    # No notify: an idle stream has completed all before `seq`, so nobody waits on it.
                    self._completed = seq
                    return seq
            op = _Op(seq, issued, fn)
            if on_idle is not None and idle:
                on_idle(max(issued, self._cursor))
            self._queue.append(op)
            self._work.notify()
            return op.seq

    def enqueue_copy(self, engine: CopyEngine, job: CopyJob, issued_at: float | None = None) -> int:
        submitted = False

        def submit(ready: float) -> None:
            nonlocal submitted
            job.ready = ready
            engine.submit(job)
            submitted = True

        def run(ready: float) -> float:
            if not submitted:
                submit(ready)
            job.done.wait()
            if job.error is not None:
                raise job.error
            return job.end

        def at_once(ready: float) -> float | None:
            return engine.place_at_once(job, ready)

        return self.enqueue(run, on_idle=submit, at_once=at_once, issued_at=issued_at)

    @property
    def tail(self) -> float:
        """Modelled end of the work completed or placed so far."""
        with self._cond:
            return self._cursor

    # -- worker -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._work.wait()
                op = self._queue.popleft()
                if op.fn is None:
                    return
                self._busy = True
                ready = max(op.issued, self._cursor)
            end, error = ready, None
            try:
                end = op.fn(ready)
            except BaseException as exc:
                error = exc
            with self._cond:
                if error is not None:
                    self._errors.append((op.seq, error))
                self._cursor = max(self._cursor, end)
                self._completed = op.seq
                self._busy = False
                self._cond.notify_all()

    def _wait_for(self, seq: int) -> None:
        with self._cond:
            while self._completed < seq:
                self._cond.wait()

    def take_errors(self, up_to: int) -> list[BaseException]:
        with self._cond:
            taken = [e for s, e in self._errors if s <= up_to]
            self._errors = [(s, e) for s, e in self._errors if s > up_to]
            return taken

    # -- Stream API -------------------------------------------------------------------------
    def synchronize(self) -> None:
        with self._cond:
            target = self._issued
        self._wait_for(target)
        sleep_until(self.tail)  # timed mode: the placed work ends in the future
        errors = self.take_errors(target)
        self._runtime.sync_point()
        _raise_errors(errors)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, EmulatedEvent):
            raise DeviceError(f"an emulated stream cannot wait on {type(event).__name__}")
        marker = event.marker  # the work the event captured now; a later record does not matter
        if marker is None or marker.complete():
            return

        def gate(ready: float) -> float:
            marker.wait_resolved()
            return max(ready, marker.time)

        self.enqueue(gate, inline=marker.resolved)

    def query(self) -> bool:
        with self._cond:
            return self._completed >= self._issued and time.perf_counter() >= self._cursor

    def destroy(self) -> None:
        """Non-blocking, as cuStreamDestroy: queued work still runs, then the worker ends."""
        with self._cond:
            if self._destroyed:
                return
            self._destroyed = True
            self._queue.append(_Op(0, 0.0, None))
            self._work.notify()
        self._runtime.forget_stream(self)

    def stop(self) -> None:
        """Let queued work finish and end the worker (runtime close)."""
        with self._cond:
            if not self._destroyed:
                self._destroyed = True
                self._queue.append(_Op(0, 0.0, None))
                self._work.notify()
        if self.thread is not threading.current_thread():
            self.thread.join()


class EmulatedEvent(Event):
    def __init__(self, runtime: EmulatedRuntime, timing: bool = True) -> None:
        self._runtime = runtime
        self.timing = timing
        self.marker: Marker | None = None

    def record(self, stream: Stream) -> None:
        if not isinstance(stream, EmulatedStream) or stream.runtime is not self._runtime:
            raise DeviceError("an event can only be recorded on a stream of the runtime that made it")
        marker = Marker(stream)
        stream.enqueue(marker.resolve, marker=marker, inline=True)
        self.marker = marker

    def query(self) -> bool:
        marker = self.marker
        return marker is None or marker.complete()

    def synchronize(self) -> None:
        marker = self.marker
        if marker is None:
            return
        marker.wait()
        errors = marker.stream.take_errors(marker.seq)
        self._runtime.sync_point()
        _raise_errors(errors)

    def elapsed_ms(self, end: Event) -> float:
        if not isinstance(end, EmulatedEvent):
            raise DeviceError(f"cannot time an emulated event against {type(end).__name__}")
        if not (self.timing and end.timing):
            raise DeviceError("elapsed_ms needs two events created with timing=True")
        a, b = self.marker, end.marker
        if a is None or b is None:
            raise DeviceError("elapsed_ms needs two recorded events")
        if not (a.complete() and b.complete()):
            raise DeviceError("elapsed_ms: an event has not completed yet (not ready)")
        return (b.time - a.time) * 1e3
