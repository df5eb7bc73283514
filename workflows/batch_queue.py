"""The monolithic invoker's queue of invocations waiting to be sent as one batch (INFless's batching).

A function that batches (`max_batch_size` > 1 and `max_queue_delay_ms` > 0, the settings the proxy
reads) has its invocations gathered by `api_proxy.batcher.Gatherer`, per (workflow, function): each
brings the function's `batch_size` samples; a batch closes when its samples reach `max_batch_size`, or
`max_queue_delay_ms` after its first invocation arrived (a loop timer checks the deadlines). A closed
batch is handed to the invoker's `dispatch`, which sends its invocations to ONE instance as one message
(`monolithic.py`); members whose callers stopped waiting meanwhile are left out (of an open batch at
once: `leave`, so that their samples no longer fill it).

The policy is the proxy's own (pure) code; this is its asyncio shell: timers and futures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from streambox.api_proxy.batcher import Batch, Gatherer, Limits


class Delivered(NamedTuple):
    """What a queued invocation gets back: its instance's reply, whether that instance started cold
    for this batch, and how long the invocation waited before it was sent."""

    reply: dict[str, Any]
    cold: bool
    waited_s: float


@dataclass(eq=False)
class Pending:
    """One invocation waiting in a batch."""

    event: dict[str, Any]
    request_id: str
    deadline: float | None  # time.monotonic() when its caller stops waiting (None: never)
    started: float  # time.perf_counter() when it was invoked
    reply: asyncio.Future[Delivered] = field(default_factory=lambda: _loop().create_future())

    @property
    def waiting(self) -> bool:
        """Its caller still waits (not cancelled, not timed out, not answered)."""
        return not self.reply.done()


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


Dispatch = Callable[[Hashable, list[Pending]], None]


class BatchQueue:
    """Open batches of every batching function, and the timer that closes them at their deadline."""

    def __init__(self, dispatch: Dispatch) -> None:
        self._dispatch = dispatch
        self._gatherer: Gatherer[Pending] = Gatherer()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def add(self, kind: Hashable, pending: Pending, samples: int, limits: Limits) -> Batch[Pending]:
        """`pending` joins its function's open batch (returned); batches this closed are dispatched at
        once."""
        batch, closed = self._gatherer.add(kind, pending, samples, limits, time.monotonic())
        self._hand_over(closed)
        self._arm()
        return batch

    def leave(self, batch: Batch[Pending], pending: Pending) -> None:
        """`pending`'s caller stopped waiting: out of `batch` if it is still open, so its samples no
        longer fill it (a closed batch is sent without the members that stopped waiting)."""
        self._gatherer.leave(batch, pending)

    def fail_all(self, error: Callable[[Hashable], BaseException]) -> None:
        """Fail every waiting invocation with `error(its batch's kind)` (the invoker closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for batch in self._gatherer.due(float("inf")):
            for pending in batch.members:
                if pending.waiting:
                    pending.reply.set_exception(error(batch.kind))

    def __len__(self) -> int:
        return len(self._gatherer)

    def _hand_over(self, batches: list[Batch[Pending]]) -> None:
        for batch in batches:
            members = [p for p in batch.members if p.waiting]
            if members:
                self._dispatch(batch.kind, members)

    def _arm(self) -> None:
        """A timer at the earliest open deadline (one timer for all batches)."""
        deadline = self._gatherer.next_deadline()
        if deadline is None:
            return
        if self._timer is not None:
            if self._timer_at <= deadline:
                return
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._hand_over(self._gatherer.due(time.monotonic()))
        self._arm()  # the next deadline (or this one again, when the timer fired a hair early)
