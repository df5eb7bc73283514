"""The runtime's memory pool: the one source of device bytes for the functions of a proxy.

A thin shell around the pure `SubAllocator`. It takes device memory from the backend's
stream-ordered pool (`Runtime.create_pool`, i.e. cuMemPool / cuMemAllocAsync) in chunks, carves
them with the sub-allocator and gives whole free chunks back (`free_async` + `trim_to`).

Chunks (`chunk_size_for`): a request the pool cannot place adds one `chunk_bytes` chunk (2 MiB by
default, CUDA's large-page granule); a larger request gets a chunk of its own, rounded up to a
multiple of `chunk_bytes`, whose tail serves later small requests. Small chunks keep trimming
effective: a chunk goes back to the device only when it is entirely free.

Frees are stream-ordered, as with cuMemFreeAsync. `free_many(addresses, stream)` makes the blocks
*pending* on `stream`:

- later allocations on the same stream may reuse a pending block of the same aligned size at once
  (stream order makes that safe; DNN plans repeat tensor sizes, so this is the common case);
- a *fence* (one event recorded on the stream, amortised over the frees since the previous fence:
  every `fence_bytes` bytes or `fence_frees` frees, at the end of each run, before the pool grows,
  and by the periodic `collect`) marks the point after which the blocks are free for every
  stream: once the event has completed, the blocks go back to the sub-allocator and coalesce
  (`collect`; also on the stream's next `free_many` and when an allocation does not fit).

`free_and_allocate(addresses, sizes, stream)` is `free_many` then an allocation of each size, under
one acquisition of the lock with one metrics update: the executor's one call per kernel (the blocks
the previous kernel spent, then the ones this kernel touches first, which may reuse them at once).

Run-ahead bound: once more than `run_ahead_bytes` (4 MiB) of a stream's fenced frees wait for the
device, `free_many` waits for the oldest fence before it returns (flow control: the issuing thread
stays near its device, so freed blocks come back soon after; `counters.run_ahead_waits`).

When nothing fits, an allocation (1) collects completed fences; (2) if its own stream has fenced
frees in flight that could make room, waits for the oldest of them instead of growing (the host
waits, the device keeps running the work queued after the fence) -- this keeps the pool at the
demand of the kernels being *issued* even when the host runs ahead of the device; (3) grows the
pool by a chunk (a surge beyond any prediction still succeeds); (4) under device pressure returns
`Reclaim(nbytes)` from `try_allocate`: what it needs its users to give back (idle weights evicted,
stored data moved off the GPU), which the caller does *outside the pool's lock* before resuming the
allocation with `try_allocate(..., resume=that)` (CuPy's `_try_malloc` ladder, vLLM's `AllocStatus`:
the pool decides, its owner acts; the pool never calls up); then it gives its free chunks back so
the device can hand out one large enough; (5) waits, at most `oom_wait_s`, for frees in flight
anywhere (asking for a reclaim again after each wait); then (6) fails this one request with
`PoolOutOfMemory`, naming the requested, free and pool bytes. The pool and the other functions go
on. `allocate` is the same ladder for a caller with nothing to reclaim.

Which pool mode (static / fm / fm+rs) runs is decided above this class: the executor decides
lazy allocation and eager recycling, the `ResilientScaler` resizes the pool in fm+rs. Static and fm
simply never call `trim_to`/`resize`.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from streambox.device.base import (
    ALIGNMENT,
    DeviceError,
    Event,
    InvalidAddress,
    OutOfDeviceMemory,
    Runtime,
    Stream,
)

from .metrics import PoolMetrics
from .suballocator import SubAllocator, SubAllocatorStats

__all__ = [
    "DeviceMemoryPool",
    "Reclaim",
    "PoolConfig",
    "PoolCounters",
    "PoolOutOfMemory",
    "PoolStats",
    "chunk_size_for",
]

MiB = 1 << 20
_MASK = ~(ALIGNMENT - 1)


@dataclass
class _Ladder:
    """Where an allocation that does not fit stands on the slow path (kept across a `Reclaim`)."""

    started: float
    wait_own: bool
    deadline: float | None = None
    reclaimed: bool = False  # asked for a reclaim since the last wait for frees in flight


@dataclass
class Reclaim:
    """What an allocation needs before it goes on: `nbytes` given back to the pool by its users (idle
    weights evicted, stored data moved off the GPU). The caller reclaims outside the pool's lock, then
    resumes with `try_allocate(nbytes, stream, resume=this)`."""

    nbytes: int
    ladder: _Ladder = field(repr=False)


def chunk_size_for(nbytes: int, chunk_bytes: int) -> int:
    """Bytes of the chunk to add for a request of `nbytes` that the pool cannot place.

    One `chunk_bytes` chunk for a small request; a request larger than that gets its own chunk,
    rounded up to a multiple of `chunk_bytes`.
    """
    if nbytes < 0 or chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
        raise ValueError(
            f"need nbytes >= 0 and chunk_bytes a multiple of {ALIGNMENT}: {nbytes}, {chunk_bytes}"
        )
    return max(chunk_bytes, -(-nbytes // chunk_bytes) * chunk_bytes)


@dataclass(frozen=True)
class PoolConfig:
    """Knobs of the pool shell (the mode lives above it)."""

    chunk_bytes: int = 2 * MiB
    fence_bytes: int = 1 * MiB  # record a fence once this many freed bytes wait on one stream...
    fence_frees: int = 64  # ...or this many frees
    wait_own_frees: bool = True  # before growing, wait for this stream's fenced frees in flight
    # Run-ahead bound: once more than this many bytes of a stream's fenced frees wait for the device
    # to reach them, the freeing thread waits for the oldest fence (None: never).
    run_ahead_bytes: int | None = 16 * MiB
    oom_wait_s: float = 0.5  # bounded wait for frees in flight before an allocation fails
    metrics: bool = True
    series_limit: int = 100_000
    series_interval_s: float = 1e-3

    def __post_init__(self) -> None:
        chunk_size_for(0, self.chunk_bytes)  # validates chunk_bytes
        check_fields(
            self,
            fence_bytes=(self.fence_bytes >= 0, ">= 0"),
            fence_frees=(self.fence_frees >= 1, ">= 1"),
            oom_wait_s=(0 <= self.oom_wait_s < math.inf, "finite and >= 0"),
            run_ahead_bytes=(self.run_ahead_bytes is None or self.run_ahead_bytes >= 0, ">= 0 or None"),
            series_limit=(self.series_limit >= 1, ">= 1"),
            series_interval_s=(0 <= self.series_interval_s < math.inf, "finite and >= 0"),
        )


def check_fields(config: object, **rules: tuple[bool, str]) -> None:
    """Raise ValueError naming each field of `config` whose rule, (holds, what it must be), fails."""
    bad = [f"{name} {getattr(config, name)!r} must be {must}" for name, (ok, must) in rules.items() if not ok]
    if bad:
        raise ValueError(f"{type(config).__name__}: {'; '.join(bad)}")


class PoolOutOfMemory(OutOfDeviceMemory):
    """An allocation the pool could not meet even after trimming and a bounded wait."""

    def __init__(
        self,
        requested: int,
        free: int,
        pool_bytes: int,
        largest_free: int,
        device_free: int,
        device_total: int,
        waited_s: float,
    ) -> None:
        self.requested, self.free, self.total = requested, free, device_total
        self.pool_bytes, self.largest_free, self.device_free = pool_bytes, largest_free, device_free
        DeviceError.__init__(
            self,
            f"memory pool out of memory: requested {requested} bytes; {free} bytes free in the pool "
            f"(largest free block {largest_free}) of {pool_bytes} pool bytes; device: {device_free} of "
            f"{device_total} bytes free (after trimming and waiting {waited_s:.3f} s)",
        )


@dataclass
class PoolCounters:
    """Event counts since the pool was made (for reports; not exact under concurrent reads)."""

    allocations: int = 0
    frees: int = 0
    same_stream_reuses: int = 0
    fences: int = 0
    grows: int = 0
    grow_bytes: int = 0
    grow_s: float = 0.0  # time spent growing, with the pool's lock held (the device's reserve, synced)
    trims: int = 0
    trim_bytes: int = 0
    trim_s: float = 0.0  # time spent trimming, with the pool's lock held
    own_frees_waits: int = 0
    own_frees_wait_s: float = 0.0
    run_ahead_waits: int = 0
    run_ahead_wait_s: float = 0.0
    pressure_trims: int = 0
    out_of_memory: int = 0


@dataclass(frozen=True)
class PoolStats:
    reserved_bytes: int
    allocated_bytes: int
    demand_bytes: int
    pending_free_bytes: int
    live_allocations: int
    sub: SubAllocatorStats
    counters: PoolCounters = field(default_factory=PoolCounters)


class _StreamFrees:
    """Blocks freed on one stream and not yet given back to every stream."""

    __slots__ = ("stream", "pending", "pending_bytes", "by_size", "unfenced", "unfenced_bytes", "fenced")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.pending: dict[int, int] = {}  # address -> token of its latest free
        self.pending_bytes = 0
        self.by_size: dict[int, dict[int, None]] = {}  # aligned size -> pending addresses
        self.unfenced: list[tuple[int, int, int]] = []  # (address, token, size) since the last fence
        self.unfenced_bytes = 0
        self.fenced: deque[tuple[Event, list[tuple[int, int, int]]]] = deque()

    def take(self, size: int) -> int | None:
        """The last freed pending block of exactly `size` bytes, for reuse on this same stream."""
        bucket = self.by_size.get(size)
        if not bucket:
            return None
        address = next(reversed(bucket))
        self.drop(address, size)
        return address

    def take_exact(self, address: int, size: int) -> int | None:
        """`address` if it is a pending block of `size` bytes (taken), else None."""
        bucket = self.by_size.get(size)
        if bucket is None or address not in bucket:
            return None
        self.drop(address, size)
        return address

    def drop(self, address: int, size: int) -> None:
        del self.pending[address]
        self.pending_bytes -= size
        bucket = self.by_size[size]
        del bucket[address]
        if not bucket:
            del self.by_size[size]

    @property
    def idle(self) -> bool:
        return not (self.pending or self.fenced or self.unfenced)


class _FenceHold:
    """A stream's `hold_fences`: how many holders, whether a fence was asked for meanwhile, and
    whether it freed blocks since its last release whose kernels may not be launched yet (only
    those make a fence wait: a holder waiting with everything launched defers nothing)."""

    __slots__ = ("count", "due", "unlaunched")

    def __init__(self) -> None:
        self.count, self.due, self.unlaunched = 1, False, False


def _aligned(nbytes: int) -> int:
    if nbytes <= ALIGNMENT:
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        return ALIGNMENT
    return (nbytes + ALIGNMENT - 1) & _MASK


def _wait(event: Event, timeout_s: float) -> bool:
    """Wait until `event` completes or `timeout_s` passes. Never `synchronize`: that would take
    the stream's kernel errors away from the function that owns the stream. An emulated event's
    completion flag (`marker.done`, a `threading.Event`) is waited on directly; other events are
    polled with a growing pause."""
    done = getattr(getattr(event, "marker", None), "done", None)
    if isinstance(done, threading.Event):
        return done.wait(max(0.0, timeout_s))
    deadline = time.perf_counter() + timeout_s
    pause = 20e-6
    while not event.query():
        if time.perf_counter() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


class DeviceMemoryPool:
    """Chunks from the backend's stream-ordered pool, sub-allocated; the executor's `Allocator`.

    Thread-safe (one re-entrant lock). `allocate`/`free` implement the executor's protocol;
    `free_many` frees a batch with one fence decision.
    """

    def __init__(self, runtime: Runtime, config: PoolConfig | None = None) -> None:
        self.runtime = runtime
        self.config = config or PoolConfig()
        self._backend = runtime.create_pool(0)
        self._stream = runtime.create_stream()  # the pool's own stream: chunk allocs and frees
        self._sub = SubAllocator()
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}  # address -> requested bytes
        self._demand = 0
        self._streams: dict[Stream, _StreamFrees] = {}
        self._holds: dict[Stream, _FenceHold] = {}  # streams whose fences wait (`hold_fences`)
        self._token = 0
        self.counters = PoolCounters()
        self.metrics: PoolMetrics | None = (
            PoolMetrics(
                time.perf_counter, self.config.series_limit, self.config.series_interval_s, lock=self._lock
            )
            if self.config.metrics
            else None
        )
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<DeviceMemoryPool reserved={self._sub.reserved_bytes} allocated={self._sub.allocated_bytes} "
            f"demand={self._demand}>"
        )

    # -- the executor's Allocator protocol ------------------------------------------------------
    def allocate(self, nbytes: int, stream: Stream) -> int:
        """An address of at least `nbytes` device bytes usable by work issued to `stream` from now on
        (a caller with nothing to reclaim: the slow path goes on without asking)."""
        got = self.try_allocate(nbytes, stream)
        while isinstance(got, Reclaim):
            got = self.try_allocate(nbytes, stream, resume=got)
        return got

    def try_allocate(self, nbytes: int, stream: Stream, resume: Reclaim | None = None) -> int | Reclaim:
        """`allocate`, or `Reclaim` when the pool needs memory back from its users first; `resume`
        continues an allocation after the caller reclaimed what an earlier `Reclaim` asked for."""
        ladder = resume.ladder if resume is not None else None
        started = ladder.started if ladder is not None else time.perf_counter()
        size = _aligned(nbytes)
        with self._lock:
            if self._closed:
                raise DeviceError("memory pool is closed")
            address = None
            if ladder is None:  # the fast path, inline (once per kernel of a lazily allocated plan)
                frees = self._streams.get(stream)
                if frees is not None and frees.pending:
                    address = frees.take(size)
                    if address is not None:
                        self.counters.same_stream_reuses += 1
                if address is None:
                    address = self._sub.allocate(size)
            if address is None:
                if ladder is None:
                    ladder = _Ladder(started, self.config.wait_own_frees)
                address = self._allocate_slow(nbytes, size, stream, ladder)
                if isinstance(address, Reclaim):
                    return address
            self._live[address] = nbytes
            demand = self._demand = self._demand + nbytes
            self.counters.allocations += 1
            metrics = self.metrics
            if metrics is not None:
                now = time.perf_counter()
                sub = self._sub
                metrics.update(now, sub._reserved, sub._allocated, demand)
                metrics.record_alloc(now - started)
        return address

    def free(self, address: int, stream: Stream | None) -> None:
        """Free one block, stream-ordered on `stream` (None: no device work uses it any more)."""
        self.free_many((address,), stream)

    def free_many(self, addresses: Iterable[int], stream: Stream | None) -> None:
        """Free blocks after the work issued to `stream` so far (None: free for every stream now)."""
        started = time.perf_counter()
        with self._lock:
            frees, count = self._free_locked(addresses, stream)
            self._after_frees(frees, count, started)

    def free_and_allocate(
        self,
        addresses: Sequence[int],
        sizes: Sequence[int],
        stream: Stream,
        allocate: Callable[[int, Stream], int] | None = None,
        *,
        fast_only: bool = False,
        prefer: Sequence[int] | None = None,
    ) -> list[int]:
        """`free_many(addresses, stream)`, then an `allocate` on `stream` of each of `sizes`, in one
        call: the executor's per-kernel call (the blocks the previous kernel spent, the ones the next
        kernel touches first). The frees come first, so the allocations may reuse them at once.
        The fast path runs under one acquisition of the lock; a size it cannot place goes through
        `allocate` (default: this pool's), e.g. an owner's that reclaims, unless `fast_only`
        (`free_and_try_allocate`). `prefer`: per size, an address to reuse if it is one of the
        stream's pending blocks of that size (the executor passes the kernel's addresses of the
        previous run, so that a warm instance's buffers keep their addresses and its bound calls)."""
        started = time.perf_counter()
        got: list[int] = []
        with self._lock:
            if self._closed:
                raise DeviceError("memory pool is closed")
            freed = 0
            if addresses:
                frees, freed = self._free_locked(addresses, stream)
                self.counters.frees += freed
            else:
                frees = self._streams.get(stream)
            if sizes:
                self._allocate_fast_locked(sizes, frees, got, prefer)
            metrics = self.metrics
            if metrics is not None and (freed or got):
                now = time.perf_counter()
                sub, allocs = self._sub, len(got)
                each = (now - started) / (freed + allocs)  # one call's time, amortised
                metrics.record_batch(now, sub._reserved, sub._allocated, self._demand, each, freed, allocs)
            if freed:
                self._bound_if_ahead(frees)
        if len(got) == len(sizes) or fast_only:  # the fast path placed them all (the common case)
            return got
        allocate = allocate or self.allocate
        try:
            for nbytes in sizes[len(got) :]:
                got.append(allocate(nbytes, stream))
        except BaseException:  # nothing used them yet: hand them back, stream-ordered
            self.free_many(got, stream)
            raise
        return got

    def hold_fences(self, stream: Stream) -> None:
        """Until `release_fences(stream)`, once the stream frees a block no fence is recorded on it
        without its caller's event: one the pool would record now (its thresholds, the periodic
        sweep, another stream's slow path) is recorded at the release instead. For a caller that
        frees blocks before it launches the kernels that use them last (the executor issues a run's
        kernels a segment at a time): a fence recorded in between would give a block to every
        stream while a kernel launched after it still uses it. The stream itself may reuse its
        pending blocks at once, as stream order runs the kernels launched first before the ones that
        reuse them. After `release_fences(stream, hold=True)` (everything launched) fences are
        recorded as usual until the stream's next free. Holds nest."""
        with self._lock:
            hold = self._holds.get(stream)
            if hold is None:
                self._holds[stream] = _FenceHold()
            else:
                hold.count += 1

    def release_fences(self, stream: Stream, *, hold: bool = False) -> None:
        """End a `hold_fences(stream)`: the kernels of the frees so far are launched, so a fence asked
        for meanwhile, or one the thresholds call for, is recorded now. `hold=True`: hold again at
        once (a segment launched, the next one begins), under the same acquisition of the lock."""
        with self._lock:
            held = self._holds.get(stream)
            if held is None:
                raise ValueError(f"release_fences: the fences of {stream!r} are not held")
            if held.count > 1:  # an outer hold goes on: its release records the fence
                held.count -= not hold
                return
            due = held.due
            if hold:  # every free so far has its kernels launched: nothing makes a fence wait now
                held.due = held.unlaunched = False
            else:
                del self._holds[stream]
            frees = self._streams.get(stream)
            if frees is not None and frees.unfenced and (due or self._fence_due(frees)):
                self._fence_locked(frees, None, force=True)

    def _fence_due(self, frees: _StreamFrees) -> bool:
        config = self.config
        return frees.unfenced_bytes >= config.fence_bytes or len(frees.unfenced) >= config.fence_frees

    def free_and_try_allocate(
        self, addresses: Sequence[int], sizes: Sequence[int], stream: Stream
    ) -> list[int]:
        """`free_and_allocate` on the fast path only, under one acquisition of the lock: stops at the
        first size no pending or free block fits and returns the addresses so far (the caller
        allocates the rest, e.g. with `try_allocate`, which grows, waits or asks for a reclaim)."""
        return self.free_and_allocate(addresses, sizes, stream, fast_only=True)

    def _allocate_fast_locked(
        self,
        sizes: Sequence[int],
        frees: _StreamFrees | None,
        got: list[int],
        prefer: Sequence[int] | None = None,
    ) -> None:
        """`try_allocate`'s fast path for each of `sizes` in turn (a pending block of the stream: the
        preferred address if it is one, else the last freed of that size; else the sub-allocator),
        appending to `got`; stops at the first that needs the slow path."""
        live, sub, demand, reuses = self._live, self._sub, self._demand, 0
        take = frees.take if frees is not None and frees.pending else None
        exact = frees.take_exact if take is not None else None
        preferred = prefer or ()
        try:
            for j, nbytes in enumerate(sizes):
                size = _aligned(nbytes)
                address = None
                if j < len(preferred) and preferred[j]:
                    if exact is not None:
                        address = exact(preferred[j], size)
                    if address is not None:
                        reuses += 1
                    else:  # its old block went back to the sub-allocator meanwhile: that address anew
                        address = sub.allocate_at(preferred[j], size)
                if address is None and take is not None:
                    address = take(size)
                    if address is not None:  # the common case of a lazily allocated plan
                        reuses += 1
                if address is None:
                    address = sub.allocate(size)
                    if address is None:
                        return
                live[address] = nbytes
                demand += nbytes
                got.append(address)
        finally:
            self._demand = demand
            self.counters.allocations += len(got)
            self.counters.same_stream_reuses += reuses

    def _free_locked(
        self, addresses: Iterable[int], stream: Stream | None
    ) -> tuple[_StreamFrees | None, int]:
        """The frees of `free_many`, lock held; returns the stream's frees (None for `stream=None`)
        and how many blocks were freed."""
        count = 0
        frees: _StreamFrees | None = None
        live = self._live
        if stream is None:
            for address in addresses:
                self._demand -= self._pop_live(address)
                self._sub.free(address)
                count += 1
            return None, count
        frees = self._streams.get(stream)
        if frees is None:
            frees = self._streams[stream] = _StreamFrees(stream)
        if self._holds:
            held = self._holds.get(stream)
            if held is not None:  # the caller launches these blocks' last kernels later
                held.unlaunched = True
        pending, by_size, unfenced = frees.pending, frees.by_size, frees.unfenced
        token, freed_bytes, freed_demand = self._token, 0, 0
        try:
            for address in addresses:
                nbytes = live.pop(address, None)
                if nbytes is None:
                    self._pop_live(address)  # raises the right error
                freed_demand += nbytes
                size = ALIGNMENT if nbytes <= ALIGNMENT else (nbytes + ALIGNMENT - 1) & _MASK
                token += 1
                pending[address] = token
                bucket = by_size.get(size)
                if bucket is None:
                    by_size[size] = {address: None}
                else:
                    bucket[address] = None
                unfenced.append((address, token, size))
                freed_bytes += size
                count += 1
        finally:  # the frees before a bad address happened: account for them
            self._token = token
            self._demand -= freed_demand
            frees.unfenced_bytes += freed_bytes
            frees.pending_bytes += freed_bytes
        if self._fence_due(frees):
            self._fence_locked(frees, None)
        if frees.fenced and frees.fenced[0][0].query():
            # Only this stream's completed fences here (one query): the others are collected
            # by their own frees, by an allocation that does not fit, and by the sweep.
            self._collect_stream(frees)
        return frees, count

    def _after_frees(self, frees: _StreamFrees | None, count: int, started: float) -> None:
        """Counters and metrics of `count` frees begun at `started`, then the run-ahead bound (lock held)."""
        self.counters.frees += count
        metrics = self.metrics
        if metrics is not None and count:
            now = time.perf_counter()
            sub = self._sub
            metrics.update(now, sub._reserved, sub._allocated, self._demand)
            metrics.record_free((now - started) / count, count)
        self._bound_if_ahead(frees)

    def _bound_if_ahead(self, frees: _StreamFrees | None) -> None:
        limit = self.config.run_ahead_bytes
        if (
            frees is not None
            and limit is not None
            and frees.fenced
            and frees.pending_bytes - frees.unfenced_bytes > limit
        ):
            self._bound_run_ahead(frees, limit)  # flow control, not in the free latency

    def _bound_run_ahead(self, frees: _StreamFrees, limit: int) -> None:
        """Wait (lock released) until at most `limit` bytes of the stream's fenced frees are still
        ahead of the device, collecting each fence it passes: a host that frees big blocks stays
        within about one kernel of its device, so the pool follows the issued demand instead of
        holding what the host freed long before the device got there. Only big frees wait (small
        plans never reach `limit`), and those kernels run long enough that the device's idle gap
        until the host issues the next one (the event's wake-up, ~0.1 ms) is small. Bounded by
        `oom_wait_s`: a stuck stream stops the waiting, the free has happened either way."""
        started = time.perf_counter()
        deadline = started + self.config.oom_wait_s
        fenced = frees.fenced
        waited = False
        while fenced:
            if frees.pending_bytes - frees.unfenced_bytes <= limit:
                break
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not self._unlocked_wait(fenced[0][0], remaining):
                break
            waited = True
            self._collect_stream(frees)
        if waited:
            self.counters.run_ahead_waits += 1
            self.counters.run_ahead_wait_s += time.perf_counter() - started
            self._update_metrics()

    def fence(self, stream: Stream, event: Event | None = None) -> None:
        """Make the frees issued so far on `stream` free for every stream once it reaches this point.

        `event`, if given, must have been recorded on `stream` after those frees (e.g. a run's
        `done` event); otherwise one is recorded.
        """
        with self._lock:
            frees = self._streams.get(stream)
            if frees is not None:
                self._fence_locked(frees, event)
            self._collect_locked()

    def retire_stream(self, stream: Stream, timeout_s: float | None = None) -> bool:
        """`stream` is about to be destroyed: fence its frees, wait until it reaches them, give the
        blocks back to every stream and forget the stream, so no pending block refers to it.

        Call it after the last free on `stream` and before `stream.destroy()`. Returns False (and
        keeps tracking the stream, whose blocks then stay pending) when the stream did not get there
        within `timeout_s` (default: `oom_wait_s`, at least 1 s); never a `synchronize`, so the
        stream's kernel errors stay its owner's.
        """
        timeout_s = max(self.config.oom_wait_s, 1.0) if timeout_s is None else timeout_s
        with self._lock:
            frees = self._streams.get(stream)
            if frees is None:
                return True
            self._fence_locked(frees, None)
            waiting = [event for event, _ in frees.fenced]
        for event in waiting:
            if not _wait(event, timeout_s):
                return False
        with self._lock:
            self._collect_stream(frees)
            if frees.idle and self._streams.get(stream) is frees:
                del self._streams[stream]
            self._update_metrics()
            return stream not in self._streams

    def tracked_streams(self) -> list[Stream]:
        """Streams with frees not yet given back to every stream (pending, or fenced in flight)."""
        with self._lock:
            return [s for s, frees in self._streams.items() if not frees.idle]

    def _pop_live(self, address: int) -> int:
        try:
            return self._live.pop(address)
        except KeyError:
            raise InvalidAddress(
                f"free of device address {address:#x}: not a live allocation of this pool (double free?)"
            ) from None

    def _fence_locked(self, frees: _StreamFrees, event: Event | None, *, force: bool = False) -> None:
        if not frees.unfenced:
            return
        if event is None and self._holds and not force:
            held = self._holds.get(frees.stream)
            if held is not None and held.unlaunched:  # `hold_fences`: recorded at the release
                held.due = True
                return
        if event is None:
            event = self.runtime.create_event(timing=False)
            event.record(frees.stream)
        frees.fenced.append((event, frees.unfenced))
        frees.unfenced = []
        frees.unfenced_bytes = 0
        self.counters.fences += 1

    def _collect_locked(self) -> int:
        """Give blocks whose fence has completed back to the sub-allocator; returns bytes collected."""
        collected = 0
        idle = []
        for stream, frees in self._streams.items():
            collected += self._collect_stream(frees)
            if frees.idle:
                idle.append(stream)
        for stream in idle:
            del self._streams[stream]
        return collected

    def _collect_stream(self, frees: _StreamFrees) -> int:
        collected = 0
        fenced = frees.fenced
        pending = frees.pending
        while fenced and fenced[0][0].query():
            _, batch = fenced.popleft()
            for address, token, size in batch:
                if pending.get(address) == token:  # not reused (and freed again) meanwhile
                    frees.drop(address, size)
                    self._sub.free_deferred(address)  # often taken back whole by its next run
                    collected += size
        return collected

    def collect(self, fence: bool = True) -> int:
        """Give blocks whose stream has passed their free back to every stream; returns the bytes.

        `fence=True` (the periodic sweep) also fences every stream's frees that no fence covers yet,
        so that a lone free on a stream that frees nothing more is not pending forever.
        """
        with self._lock:
            if fence:
                for frees in self._streams.values():
                    self._fence_locked(frees, None)
            collected = self._collect_locked()
            self._update_metrics()
            return collected

    # -- growing, waiting, failing --------------------------------------------------------------
    def _allocate_slow(self, nbytes: int, size: int, stream: Stream, ladder: _Ladder) -> int | Reclaim:
        """Called with the lock held when no free block fits (again after a `Reclaim`)."""
        if ladder.reclaimed:  # back from reclaiming: give our free chunks to the device (they may add
            self._collect_locked()  # up to enough but be scattered; the device can hand out one)
            self._trim_locked(0)
        while True:
            self._collect_locked()
            address = self._sub.allocate(size)
            if address is not None:
                return address
            own = self._streams.get(stream)
            if (
                ladder.wait_own
                and own is not None
                and own.fenced
                and own.pending_bytes + self._sub.reserved_bytes - self._sub.allocated_bytes >= size
            ):  # once this stream's frees land (coalescing with free neighbours), it may fit
                self.counters.own_frees_waits += 1
                waited = time.perf_counter()
                # A stream that does not get there in time (a kernel stuck) stops this waiting.
                ladder.wait_own = self._unlocked_wait(own.fenced[0][0], self.config.oom_wait_s)
                self.counters.own_frees_wait_s += time.perf_counter() - waited
                continue
            for frees in self._streams.values():  # lone frees elsewhere: collectable soon
                self._fence_locked(frees, None)
            try:
                self._grow_locked(chunk_size_for(size, self.config.chunk_bytes))
                continue
            except OutOfDeviceMemory:
                pass
            if not ladder.reclaimed:
                ladder.reclaimed = True
                self.counters.pressure_trims += 1
                return Reclaim(size, ladder)
            self._wait_for_frees(nbytes, ladder)
            ladder.reclaimed = False

    def _wait_for_frees(self, nbytes: int, ladder: _Ladder) -> None:
        """Wait a little for frees in flight anywhere, or fail once `oom_wait_s` has passed."""
        now = time.perf_counter()
        if ladder.deadline is None:
            ladder.deadline = now + self.config.oom_wait_s
        if now >= ladder.deadline:
            self.counters.out_of_memory += 1
            free_dev, total_dev = self.runtime.memory_info()
            st = self._sub.stats()
            raise PoolOutOfMemory(
                nbytes,
                st.free_bytes,
                st.reserved_bytes,
                st.largest_free_block,
                free_dev,
                total_dev,
                now - ladder.started,
            )
        for frees in self._streams.values():
            self._fence_locked(frees, None)
        oldest = [f.fenced[0][0] for f in self._streams.values() if f.fenced]
        if oldest:
            self._unlocked_wait(oldest[0], min(ladder.deadline - now, 0.01))
        else:
            self._unlocked_sleep(min(ladder.deadline - now, 1e-3))

    def _unlocked_wait(self, event: Event, timeout_s: float) -> bool:
        self._lock.release()
        try:
            return _wait(event, timeout_s)
        finally:
            self._lock.acquire()

    def _unlocked_sleep(self, seconds: float) -> None:
        self._lock.release()
        try:
            time.sleep(max(0.0, seconds))
        finally:
            self._lock.acquire()

    def _grow_locked(self, nbytes: int) -> None:
        started = time.perf_counter()
        base = self._backend.alloc_async(nbytes, self._stream)
        # Stream-ordered memory: usable by other streams once the pool's stream has reached the alloc.
        self._stream.synchronize()
        self._sub.add_chunk(base, nbytes)
        self.counters.grows += 1
        self.counters.grow_bytes += nbytes
        self.counters.grow_s += time.perf_counter() - started
        self._update_metrics()

    def _trim_locked(self, keep_bytes: int) -> int:
        plan = self._sub.trim_plan(keep_bytes)
        if not plan:
            return 0
        started, released = time.perf_counter(), 0
        for base in plan:
            released += self._sub.remove_chunk(base)
            self._backend.free_async(base, self._stream)
        self._stream.synchronize()  # the backend caches the blocks when its stream reaches the frees...
        self._backend.trim_to(0)  # ...and this gives its cache back to the device
        self.counters.trims += 1
        self.counters.trim_bytes += released
        self.counters.trim_s += time.perf_counter() - started
        self._update_metrics()
        return released

    def _update_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.update(
                time.perf_counter(), self._sub.reserved_bytes, self._sub.allocated_bytes, self._demand
            )

    # -- sizing (the scaler and explicit trims) -------------------------------------------------
    def trim_to(self, keep_bytes: int = 0) -> int:
        """Give whole free chunks back to the device, keeping at least `keep_bytes`; returns bytes."""
        if keep_bytes < 0:
            raise ValueError(f"negative keep_bytes: {keep_bytes}")
        with self._lock:
            self._collect_locked()
            return self._trim_locked(keep_bytes)

    def grow_to(self, target_bytes: int) -> int:
        """Add `chunk_bytes` chunks until the pool holds at least `target_bytes` (best effort: stops
        when the device is full). The lock is taken per chunk, so allocations go on meanwhile."""
        grown = 0
        while True:
            with self._lock:
                if self._closed or self._sub.reserved_bytes >= target_bytes:
                    return grown
                try:
                    self._grow_locked(self.config.chunk_bytes)
                except OutOfDeviceMemory:
                    return grown
                grown += self.config.chunk_bytes

    def resize(self, target_bytes: int) -> int:
        """Grow or trim towards `target_bytes`; returns the change in reserved bytes."""
        before = self.reserved_bytes
        if target_bytes > before:
            self.grow_to(target_bytes)
        elif target_bytes < before:
            self.trim_to(target_bytes)
        return self.reserved_bytes - before

    # -- inspection -----------------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        """Device bytes the pool holds (its chunks)."""
        return self._sub.reserved_bytes

    @property
    def allocated_bytes(self) -> int:
        """Bytes of blocks in use (aligned), frees the streams have not reached yet included."""
        return self._sub.allocated_bytes

    @property
    def demand_bytes(self) -> int:
        """Exact live demand: requested bytes of every live (not yet freed) allocation."""
        return self._demand

    def reset_metrics(self, now: float | None = None) -> None:
        """Start a new metrics window (on `time.perf_counter`'s clock), e.g. when a measurement starts."""
        if self.metrics is not None:
            with self._lock:
                self.metrics.reset(now)

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                reserved_bytes=self._sub.reserved_bytes,
                allocated_bytes=self._sub.allocated_bytes,
                demand_bytes=self._demand,
                pending_free_bytes=sum(f.pending_bytes for f in self._streams.values()),
                live_allocations=len(self._live),
                sub=self._sub.stats(),
                counters=PoolCounters(**vars(self.counters)),
            )

    def drain(self, timeout_s: float = 10.0) -> None:
        """Fence every stream's frees and wait until all of them are back (e.g. before a final trim)."""
        with self._lock:
            for frees in self._streams.values():
                self._fence_locked(frees, None)
            waiting = [event for frees in self._streams.values() for event, _ in frees.fenced]
        for event in waiting:
            _wait(event, timeout_s)
        self.collect()

    def close(self) -> None:
        """Wait for frees in flight and give every byte back to the device (live blocks included)."""
        if self._closed:
            return
        self.drain()
        with self._lock:
            self._closed = True
            self._backend.destroy()
            self._sub = SubAllocator()
            self._stream.destroy()
            self._live.clear()
            self._demand = 0
