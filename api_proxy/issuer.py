"""Issuing plans off the dispatcher, so that one instance's long plan does not hold other instances'
calls (no head-of-line blocking).

An `infer` hands its plan's issue (`ProxyMemory.infer`: lazy allocation, launches, eager recycling)
to one of a few issuer threads and waits for it as an `Offload`: the instance is held meanwhile, so
its own later calls keep their order, while the dispatcher goes on serving every other instance.

Under the GIL two threads that both want to run Python do not share it finely (a waiting thread
gets it only after the 5 ms switch interval), so the issue is cooperatively sliced: every
`slice_kernels` kernels the issuer waits for a turn, which the dispatcher grants (`grant`: one
issue at a time, oldest first) each time it goes round its loop with nothing to do. The
dispatcher's own work (every instance's messages, completions) thus goes first, and a small call
of another instance waits about one slice per step, not the whole plan.

A turn costs two thread hand-offs, so an issue asks for one only when somebody else waits: another
issue at its slice boundary, or the dispatcher with work at hand (`contended`: a message in a ring,
a posted callback, a completed device event to deliver). A plan issued alone runs without turns.

Between themselves the issues take the floor (`IssueFloor`): one issues at a time, and at each slice
boundary it hands the floor to the oldest issue waiting for it, so a small call waits at most one
slice of a long plan, and two long plans alternate slice by slice. Without the floor they would
interleave kernel by kernel: every launch then hands the GIL and the device's placement lock back
and forth between the issuer threads (the emulated device's ledger lock is a system call that gives
the GIL up), which cost a Traffic request's fan-out more than its kernels' own host work
(docs/api_proxy.md, "FM's host cost").

A ticket can be cancelled (its instance died): the issue stops at the next slice boundary, the
executor hands back what the run held, and outputs of a run that finished unseen are freed.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from streambox.device import Stream

from .executor import RunResult
from .run_issue import launch_pending

DEFAULT_SLICE_KERNELS = 8
DEFAULT_ISSUERS = 2
TURN_CHECK_S = 0.05  # how often an issue waiting for a turn checks whether the proxy is closing
# How long an issue waits for the floor before it goes on without it (interleaving, as without a
# floor): a holder stuck in the pool's slow path (up to `PoolConfig.oom_wait_s`, 0.5 s) may be waiting
# for memory that only the waiting issues' progress frees. A slice takes well under a millisecond.
FLOOR_PATIENCE_S = 0.2

Free = Callable[[list[int], Stream], None]
Issue = Callable[[Callable[[int, Any], None]], RunResult]  # the issue, given the per-kernel hook


class IssueCancelled(Exception):
    """The instance whose plan was being issued is gone."""


class IssueFloor:
    """One issue at a time; the floor passes to the oldest waiting issue when its holder ends or is at
    a slice boundary. A waiter that is told to stop (`stop()`: the proxy closes, its instance is gone)
    or that waited `patience_s` leaves the queue and goes on without the floor: the floor orders
    issues, it never makes one wait for another that cannot move."""

    def __init__(self, patience_s: float = FLOOR_PATIENCE_S) -> None:
        self.patience_s = patience_s
        self._lock = threading.Lock()
        self._held = False
        self._queue: deque[threading.Event] = deque()

    def acquire(self, stop: Callable[[], bool]) -> bool:
        """Wait for the floor; True once held, False if `stop()` ended the wait first."""
        with self._lock:
            if not self._held:
                self._held = True
                return True
            handed = threading.Event()
            self._queue.append(handed)
        return self._wait(handed, stop)

    def contended(self) -> bool:
        """Some issue waits for the floor."""
        return bool(self._queue)

    @property
    def held(self) -> bool:
        return self._held

    def pass_on(self, stop: Callable[[], bool]) -> bool:
        """At a slice boundary of the holder: hand the floor to the oldest waiter, if any, and wait
        for it back (True), or for `stop()` (False)."""
        with self._lock:
            if not self._queue:
                return True
            self._queue.popleft().set()
            handed = threading.Event()
            self._queue.append(handed)
        return self._wait(handed, stop)

    def release(self) -> None:
        with self._lock:
            if self._queue:
                self._queue.popleft().set()  # still held: by the next one now
            else:
                self._held = False

    def _wait(self, handed: threading.Event, stop: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + self.patience_s
        while not handed.wait(min(TURN_CHECK_S, self.patience_s)):
            if stop() or time.monotonic() >= deadline:
                with self._lock:
                    if handed.is_set():
                        return True  # handed over meanwhile: the caller holds it (and releases it)
                    self._queue.remove(handed)
                    return False
        return True


class IssueTicket:
    """One plan's issue on an issuer thread: paced into slices, cancellable."""

    def __init__(self, issuer: Issuer) -> None:
        self._waiting, self._wake, self._closed = issuer.waiting, issuer.request_turn, issuer.closed
        self._contended = issuer.is_contended
        self._floor = issuer.floor
        self._has_floor = False
        self._slice = issuer.slice_kernels
        self._lock = threading.Lock()
        self._turn = threading.Event()
        self._count = 0
        self._cancelled = False
        self._delivered = False
        self.future: Future[tuple[bool, Any]] = Future()

    def on_kernel(self, index: int, kernel: Any) -> None:
        """The executor's per-kernel hook: at each slice boundary, hand the floor to a waiting issue,
        and where somebody else waits, wait for the dispatcher's turn."""
        self._count += 1
        if self._count % self._slice == 0:
            if self._has_floor and self._floor.contended():
                launch_pending()  # the device runs this plan's issued kernels while others issue
                self._has_floor = self._floor.pass_on(self._stop)
            if self._waiting or self._contended():
                launch_pending()
                self._turn.clear()
                self._waiting.append(self._turn)  # list.append: atomic under the GIL
                self._wake()
                while not self._turn.wait(TURN_CHECK_S) and not self._closed.is_set():
                    pass  # a proxy closing grants no more turns
        if self._cancelled:
            raise IssueCancelled("the instance was dropped while its plan was being issued")

    def run(self, issue: Issue, free: Free, stream: Stream) -> None:
        """On an issuer thread: the issue; its outcome as `(True, result)` or `(False, error)`."""
        self._has_floor = self._floor.acquire(self._stop)
        try:
            result = issue(self.on_kernel)
        except BaseException as exc:  # noqa: BLE001 - handed to the call, raised there as it was
            self.future.set_result((False, exc))
            return
        finally:
            if self._has_floor:
                self._has_floor = False
                self._floor.release()
        with self._lock:
            if self._cancelled:  # nobody will take the outputs: hand them back, stream-ordered
                free([t.address for t in result.outputs.values()], stream)
                self.future.set_result((False, IssueCancelled("the instance was dropped")))
                return
            self._delivered = True
        self.future.set_result((True, result))

    def _stop(self) -> bool:
        """Stop waiting for the floor: the proxy is closing or the instance is gone."""
        return self._cancelled or self._closed.is_set()

    def cancel(self, timeout_s: float) -> RunResult | None:
        """Stop the issue (its instance is gone) and wait for the thread to let go of it. Returns the
        run's result if it had been delivered already (the caller frees its outputs), else None."""
        with self._lock:
            self._cancelled = True
        self._turn.set()  # an issuer waiting for its turn goes on, and stops
        ok, value = self.future.result(timeout_s)
        return value if ok else None


class Issuer:
    """A few issuer threads; the dispatcher submits at most one plan per instance at a time (the
    instance is held while it waits), so each instance's work reaches its stream in program order."""

    def __init__(
        self,
        wake: Callable[[], None],
        *,
        threads: int = DEFAULT_ISSUERS,
        slice_kernels: int = DEFAULT_SLICE_KERNELS,
        contended: Callable[[], bool] | None = None,
        floor_patience_s: float = FLOOR_PATIENCE_S,
    ) -> None:
        """`contended()`: whether the dispatcher has work waiting (read from an issuer thread, so it
        must only look); None: always, i.e. a turn at every slice boundary. `floor_patience_s`: how
        long an issue waits for the floor (`IssueFloor`)."""
        if threads < 1 or slice_kernels < 1:
            raise ValueError(f"issuer: threads ({threads}) and slice_kernels ({slice_kernels}) must be >= 1")
        self._wake = wake
        self.contended: Callable[[], bool] = contended or (lambda: True)
        self.slice_kernels = slice_kernels
        self.waiting: list[threading.Event] = []  # issues at a slice boundary, waiting for a turn
        self.requested = threading.Event()  # set while one waits: ends the dispatcher's idle pause
        self.closed = threading.Event()
        self.floor = IssueFloor(floor_patience_s)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="streambox-issuer")

    def submit(self, issue: Issue, free: Free, stream: Stream) -> IssueTicket:
        """Run `issue(on_kernel)` on an issuer thread; the ticket's future gives `(ok, value)`."""
        ticket = IssueTicket(self)
        self._pool.submit(ticket.run, issue, free, stream)
        return ticket

    def is_contended(self) -> bool:
        """`contended()`, read from an issuer thread while the dispatcher may be changing what it
        looks at (a dict resized mid-iteration): in doubt, take the turn."""
        try:
            return self.contended()
        except RuntimeError:
            return True

    def request_turn(self) -> None:
        """From an issuer thread that just joined `waiting`: wake the dispatcher (asleep on its
        doorbell, or pausing between completion polls: `pause`)."""
        self.requested.set()
        self._wake()

    def pause(self, seconds: float) -> None:
        """The dispatcher's idle pause between completion polls, cut short by a turn's request."""
        self.requested.wait(seconds)

    def grant(self) -> None:
        """On the dispatcher, when it has nothing to do: the longest-waiting issue goes on for one
        slice (one at a time, so the dispatcher comes round again after each slice, and the
        instances' plans take turns)."""
        self.requested.clear()
        if self.waiting:
            self.waiting.pop(0).set()
        if self.waiting:
            self.requested.set()

    def close(self) -> None:
        self.closed.set()  # the dispatcher has stopped: issues still running finish without turns
        self._pool.shutdown(wait=True, cancel_futures=True)
