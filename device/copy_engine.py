"""Copy engines of the emulated device: a pure link clock and the thread that serves copies FIFO.

A runtime has one host-to-device engine, one device-to-host engine and one peer engine. Each serves
the copies of *every* stream in the order they become ready, one at a time, so a large copy issued
first delays every later stream's copy (the contention of the paper's C3 that the IO daemon removes).

The link is modelled, not measured: `LinkClock` keeps the engine's modelled time and gives each copy
`start = max(clock, ready)`, `end = start + cost`. The engine thread performs the real memcpy (none
in timed mode), then sleeps until `end` (not at all when it is behind), so the modelled throughput
is exact whatever the sleep jitter, and the timeline and event timestamps use the modelled times.

The PCIe link itself is one per GPU, shared by every runtime of every process (`SharedLink`: one
direction of it, kept in the device's ledger): an engine with a shared link enters each copy on it
at the copy's modelled ready time and the link's processor sharing (`link_share.py`) gives its end,
so two engines copying at once each get about half the bandwidth, while each engine stays FIFO for
its own runtime's streams.

Timed mode (no bytes move): a short copy issued while its engine and the link are idle is placed
whole at issue by the issuing thread (`CopyEngine.place_at_once`, `SHORT_COPY_S`), as a kernel is.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

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


class SharedLink(Protocol):
    """One direction of a GPU's link shared with other runtimes (`ledger.LinkDirection`)."""

    def join(self, ready: float, cost: float) -> tuple[int, float, float]: ...

    def poll(self, flow_id: int, now: float) -> tuple[bool, float]: ...

    def place_alone(self, ready: float, cost: float, latest: float) -> tuple[float, float] | None: ...


#: Timed mode: a copy of at most this many link seconds issued while its engine and the link are idle
#: is placed whole at issue, on the issuing thread, as a kernel is (`CopyEngine.place_at_once`), so
#: its completion wakes no host thread. Through the engine's thread a copy costs three wake-ups (the
#: engine's, the stream worker's, the waiters') that a GPU's copy engine never takes from the host;
#: on two busy cores they cost more than the copies last: a warm Traffic request's 0.6 MB uploads
#: (55 us of link) cost its function milliseconds, and Image processing's 2.4 MB download (410 us
#: pageable) took 7.6 ms under StreamBox against 3.7 ms placed at issue (docs/reproduction-log.md, "Session
#: of 2026-11-27, 05:51 UTC"). A copy arriving meanwhile waits for its end instead of sharing the
#: link with it: the short copy ends earlier than under processor sharing and the other later, each
#: by at most this much. It enters the link at most this far ahead of now.
SHORT_COPY_S = 1e-3


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
        self._busy = False  # the thread is serving a job (guarded by `_cond`)
        self.placed_at_issue = 0  # copies `place_at_once` placed (no thread served them)
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
                self._busy = False
                while not self._queue:
                    self._cond.wait()
                job = self._queue.popleft()
                self._busy = job is not None
            if job is None:
                return
            try:
                job.run()
                job.start, job.end = self._transfer(job)
            except BaseException as exc:  # recorded on the stream, raised at its next synchronize
                job.error = exc
                job.start = job.end = max(self.link.clock, job.ready)
            else:
                if self._record is not None:
                    self._record(
                        TimelineRecord(self.lane, job.kind, job.name, job.start, job.end, job.nbytes)
                    )
            job.done.set()

    def place_at_once(self, job: CopyJob, ready: float) -> float | None:
        """Timed mode: place a short copy (`SHORT_COPY_S`) whole, here, if nothing of this engine is
        queued or in flight and the shared link is idle when it enters; returns its modelled end, or
        None (then submit it). It enters the link at most `SHORT_COPY_S` ahead of now (behind this or
        other engines' copies still on the link); further ahead, it joins the link as a flow."""
        if job.cost > SHORT_COPY_S:
            return None
        with self._cond:
            if self._queue or self._busy:
                return None
            arrive = max(self.link.clock, ready)
            latest = time.perf_counter() + SHORT_COPY_S
            if arrive > latest:
                return None
            job.run()  # timed: checks the memory is still usable (raises to the issuer's stream)
            if self._shared is None:
                job.start, job.end = self.link.schedule(arrive, job.cost, job.nbytes)
            else:
                placed = self._shared.place_alone(arrive, job.cost, latest)
                if placed is None:
                    return None
                job.start, job.end = placed
                self.link.note(job.end, job.cost, job.nbytes)
            self.placed_at_issue += 1
        if self._record is not None:
            self._record(TimelineRecord(self.lane, job.kind, job.name, job.start, job.end, job.nbytes))
        job.done.set()
        return job.end

    def _transfer(self, job: CopyJob) -> tuple[float, float]:
        """Occupy the link for the job's cost; returns its modelled (start, end) once it has ended."""
        if self._shared is None:
            start, end = self.link.schedule(job.ready, job.cost, job.nbytes)
            sleep_until(end)
            return start, end
        arrive = max(self.link.clock, job.ready)  # this engine is FIFO: after its previous copy
        sleep_until(arrive)  # enter the link at the modelled time: arrivals are causal
        flow, start, end = self._shared.join(arrive, job.cost)
        while True:
            sleep_until(end)  # the end known so far; later arrivals may push it back
            done, end = self._shared.poll(flow, time.perf_counter())
            if done:
                break
        self.link.note(end, job.cost, job.nbytes)
        return start, end
