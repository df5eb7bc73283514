"""Copy engines of the emulated device: a pure link clock and the thread that serves copies FIFO.

A runtime has one host-to-device engine, one device-to-host engine and one peer engine. Each serves
the copies of *every* stream in the order they become ready, one at a time, so a large copy issued
first delays every later stream's copy (the contention of the paper's C3 that the IO daemon removes).

The link is modelled, not measured: `LinkClock` keeps the engine's modelled time and gives each copy
`start = max(clock, ready)`, `end = start + cost`. The engine thread performs the real memcpy (none
in timed mode), then sleeps until `end` (not at all when it is behind), so the modelled throughput
is exact whatever the sleep jitter, and the timeline and event timestamps use the modelled times.

The PCIe link itself is one per GPU, shared by every runtime of every process (`SharedLink`, kept in
the device's ledger): an engine with a shared link reserves link time in chunks of `CHUNK_S`, each
first come first served on the GPU's link clock, never more than `LOOKAHEAD_S` ahead of the wall
clock. Two engines copying at once therefore interleave their chunks and each gets about half the
bandwidth, while each engine stays FIFO for its own runtime's streams.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import TimelineRecord


class LinkClock:
    """The modelled clock of one engine (pure: no threads, no sleeps)."""

    def __init__(self, now: float = 0.0) -> None:
        self.clock = now
        self.busy_seconds = 0.0
        self.copies = 0
        self.nbytes = 0

    def schedule(self, ready: float, cost: float, nbytes: int = 0) -> tuple[float, float]:
        """(start, end) of a copy that became ready at `ready` and takes `cost` seconds."""
        start = max(self.clock, ready)
        end = start + cost
        self.clock = end
        self.busy_seconds += cost
        self.copies += 1
        self.nbytes += nbytes
        return start, end

    def note(self, end: float, cost: float, nbytes: int) -> None:
        """Account a copy placed elsewhere (on a shared link) that ended at `end`."""
        self.clock = max(self.clock, end)
        self.busy_seconds += cost
        self.copies += 1
        self.nbytes += nbytes


#: Link time one reservation covers: the granularity at which concurrent copies share the link.
CHUNK_S = 0.5e-3
#: How far ahead of the wall clock an engine may reserve link time.
LOOKAHEAD_S = 0.5e-3

#: (ready, cost) -> (start, end) on the GPU's shared link in one direction (`Ledger.reserve_link`).
SharedLink = Callable[[float, float], tuple[float, float]]


def sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


@dataclass(eq=False)
class CopyJob:
    """One copy handed to an engine. `run` does the memcpy; the engine fills start/end/error."""

    kind: str
    name: str
    nbytes: int
    cost: float
    ready: float
    run: Callable[[], None]
    start: float = 0.0
    end: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class CopyEngine:
    """A thread serving `CopyJob`s strictly in submission order on one modelled link."""

    def __init__(
        self,
        lane: str,
        thread_name: str,
        record: Callable[[TimelineRecord], None] | None = None,
        shared: SharedLink | None = None,
    ) -> None:
        self.lane = lane
        self.link = LinkClock()
        self._shared = shared
        self._record = record
        self._queue: deque[CopyJob | None] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=thread_name, daemon=True)
        self._thread.start()

    def submit(self, job: CopyJob) -> CopyJob:
        with self._cond:
            self._queue.append(job)
            self._cond.notify()
        return job

    def stop(self) -> None:
        """Serve what is queued, then end the thread."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
            if job is None:
                return
            try:
                job.run()
            except BaseException as exc:  # recorded on the stream, raised at its next synchronize
                job.error = exc
                job.start = job.end = max(self.link.clock, job.ready)
            else:
                job.start, job.end = self._transfer(job)
                if self._record is not None:
                    self._record(
                        TimelineRecord(self.lane, job.kind, job.name, job.start, job.end, job.nbytes)
                    )
            job.done.set()

    def _transfer(self, job: CopyJob) -> tuple[float, float]:
        """Occupy the link for the job's cost; returns its modelled (start, end) once it has ended."""
        if self._shared is None:
            start, end = self.link.schedule(job.ready, job.cost, job.nbytes)
            sleep_until(end)
            return start, end
        t = max(self.link.clock, job.ready)  # this engine is FIFO: after its previous copy
        left = job.cost
        start: float | None = None
        lag = 0.0  # how late this thread serves the copy: chunks are paced from then on, so a late
        # engine does not catch up by reserving a burst of link time the others could not share
        while True:
            piece = min(left, CHUNK_S)
            sleep_until(t + lag - LOOKAHEAD_S)
            s, t = self._shared(t, piece)
            if start is None:
                start, lag = s, max(0.0, time.perf_counter() - s)
            left -= piece
            if left <= 1e-12:
                break
        assert start is not None
        self.link.note(t, job.cost, job.nbytes)
        sleep_until(t)
        return start, t
