"""How one run's kernels reach the device: one by one, or a segment at a time.

The executor's hot loop (`PlanExecutor._issue_scheduled`) decides, per kernel and in plan order,
what to free, what to allocate and what to launch; an `IssueOne` or `IssueSegments` carries that
out. `IssueSegments` launches the kernels a segment at a time (`Runtime.launch_many`: one operation
of the stream, one placement transaction in timed mode; a CUDA graph is the GPU's analogue) while
the allocations and frees stay per kernel, in the same order, so a run reuses the same blocks at the
same kernels and its peak live bytes are unchanged. Its frees then come before the launches of the
kernels that use those blocks last, so the pool holds the stream's fences (`hold_fences`) until
those launches: a fence recorded in between would give a block to every stream while a kernel
launched after the fence still uses it. What must wait (growing the pool, a reclaim, waiting for
frees) waits with nothing left unlaunched.

Segments start at `FIRST_SEGMENT` kernels and double up to `SEGMENT_KERNELS`, so the device gets its
first kernels early whatever the plan's length. An `on_kernel` hook runs before each kernel as
before, with the kernels before it possibly not launched yet: a hook about to wait (the issuer's
turn, weights still arriving) calls `launch_pending()` first, so the device does not wait with
them. A profiled run (an event after each kernel) is issued one by one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from streambox.device import Event, KernelLaunch, Runtime, Stream

from .device_model import Allocator, free_all

#: The first segment's kernels, and the most in one `launch_many`.
FIRST_SEGMENT, SEGMENT_KERNELS = 4, 32

FreeAndAllocate = Callable[..., list[int]]

_issuing = threading.local()  # .segments: the IssueSegments of the run this thread is issuing


def launch_pending() -> None:
    """Launch what the run this thread is issuing has not launched yet (nothing outside a run): for
    an `on_kernel` hook about to wait, so the device runs those kernels meanwhile."""
    segments = getattr(_issuing, "segments", None)
    if segments is not None:
        segments.flush()


class IssueOne:
    """Each kernel launched as it comes (`Runtime.launch`), with an event after it under a profile;
    the allocator's `free_and_allocate` takes its full ladder at once."""

    def __init__(
        self,
        runtime: Runtime,
        stream: Stream,
        free_and_allocate: FreeAndAllocate,
        profile: tuple[list[Event], list[int], Callable[[Stream], Event]] | None = None,
    ) -> None:
        self._runtime, self._stream, self._free_and_allocate = runtime, stream, free_and_allocate
        self._profile = profile

    def allocate(self, freeing: list[int], sizes: Sequence[int], prefer: list[int]) -> list[int]:
        return self._free_and_allocate(freeing, sizes, self._stream, prefer=prefer)

    def launch(self, index: int, launch: KernelLaunch) -> None:
        kernel, blocks, cap, name, duration = launch
        self._runtime.launch(self._stream, kernel, blocks=blocks, cu_cap=cap, name=name, duration_s=duration)
        if self._profile is not None:
            events, timed, record = self._profile
            events.append(record(self._stream))
            timed.append(index)

    def finish(self) -> None:
        """Every kernel is launched already."""

    def close(self) -> None:
        """Nothing held."""


class IssueSegments:
    """Kernels launched a segment at a time while `allocator` holds the stream's fences (module doc).
    `finish` launches what is left; `close` (always, after the run's last frees) drops what a failed
    run left unlaunched and ends the hold."""

    def __init__(
        self, runtime: Runtime, stream: Stream, allocator: Allocator, free_and_allocate: FreeAndAllocate
    ) -> None:
        self._runtime, self._stream, self._allocator = runtime, stream, allocator
        self._free_and_allocate = free_and_allocate
        self._release: Callable[..., None] = allocator.release_fences  # type: ignore[attr-defined]
        self._pending: list[KernelLaunch] = []
        self._limit = FIRST_SEGMENT
        allocator.hold_fences(stream)  # type: ignore[attr-defined]
        self._outer = getattr(_issuing, "segments", None)  # a run issued from another's hook
        _issuing.segments = self

    def allocate(self, freeing: list[int], sizes: Sequence[int], prefer: list[int]) -> list[int]:
        got = self._free_and_allocate(freeing, sizes, self._stream, prefer=prefer, fast_only=True)
        if len(got) < len(sizes):  # the slow path may wait for this stream's own frees: launch first
            try:
                self.flush()
                for nbytes in sizes[len(got) :]:
                    got.append(self._allocator.allocate(nbytes, stream=self._stream))
            except BaseException:
                free_all(self._allocator, got, self._stream)
                raise
        return got

    def launch(self, index: int, launch: KernelLaunch) -> None:
        pending = self._pending
        pending.append(launch)
        if len(pending) >= self._limit:
            self.flush()

    def flush(self) -> None:
        """The segment's kernels, then the fences their frees waited for (the hold goes on)."""
        if self._pending:
            self._runtime.launch_many(self._stream, self._pending)
            self._pending.clear()
            self._limit = min(2 * self._limit, SEGMENT_KERNELS)
        self._release(self._stream, hold=True)

    def finish(self) -> None:
        if self._pending:
            self._runtime.launch_many(self._stream, self._pending)
            self._pending.clear()

    def close(self) -> None:
        # A run that failed midway drops its unlaunched kernels: never issued, they use nothing, and
        # what they would have used is freed after the kernels that were.
        self._pending.clear()
        _issuing.segments = self._outer
        self._release(self._stream)


def allocator_calls(allocator: Allocator) -> tuple[Callable[[list[int], Stream], None], FreeAndAllocate]:
    """The executor's two calls into `allocator`: a batch free (`free_many`), and `free_and_allocate`
    (for an allocator without them: frees one by one; a batch free, then `allocate`s, no `prefer`)."""
    free_many = getattr(allocator, "free_many", None)
    free_batch: Callable[[list[int], Stream], None] = free_many or (
        lambda addresses, stream: free_all(allocator, addresses, stream)
    )

    def free_then_allocate(
        addresses: list[int], sizes: Sequence[int], stream: Stream, prefer: object = None
    ) -> list[int]:
        if addresses:
            free_batch(addresses, stream)
        got: list[int] = []
        try:
            for nbytes in sizes:
                got.append(allocator.allocate(nbytes, stream=stream))
        except BaseException:
            free_all(allocator, got, stream)
            raise
        return got

    return free_batch, getattr(allocator, "free_and_allocate", None) or free_then_allocate


def holds_fences(allocator: Allocator) -> bool:
    """Whether `allocator` can hold a stream's fences (`DeviceMemoryPool` and its wrappers can)."""
    return callable(getattr(allocator, "hold_fences", None)) and callable(
        getattr(allocator, "release_fences", None)
    )
