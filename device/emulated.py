"""The emulated backend: the default device of StreamBox, with CUDA's semantics and a modelled link.

Two execution modes (`modes.py`): `functional` (below: real bytes, kernels on the CPU) and `timed`
(GPU time: kernels last their `duration_s` on the GPU's compute units, data is phantom; see the end).

- Device memory is real host memory (one uint8 tensor per allocation) at synthetic, never-reused
  addresses (`address_space.py`), with exact byte accounting against the spec's capacity, shared by
  every process that opens the same emulated GPU (`ledger.py`).
- Creating a runtime costs `spec.context_create_s` and `spec.context_memory` device bytes.
- Streams are in-order worker threads; events follow CUDA (`emulated_stream.py`).
- Each runtime has one host-to-device, one device-to-host and one peer copy engine, served FIFO across
  all its streams on a modelled link (`copy_engine.py`). Device-to-device copies run on the stream at
  `device_bandwidth`. Pinned host buffers cost `pinned_alloc_s_per_byte` to allocate; a CPU tensor is
  pageable memory: staged at issue and moved at `pageable_bandwidth`.
- Kernels are Python callables run on the stream's worker over `view`s of device memory; compute units
  are accounted (`compute.py`). A failing kernel raises `KernelError` at the next synchronize of its
  stream and does not stop the stream.
- Every operation can be recorded on a bounded timeline (lanes `stream:<id>`, `h2d`, `d2h`, `peer`).
- One GPU per device index is shared by every runtime of every process (`ledger.py`): memory, the
  PCIe link (each runtime's FIFO copy engines in front of it; copies in flight share its bandwidth,
  `link_share.py`) and, in timed mode, the
  compute units (kernels of different contexts time-slice; MPS clients, `gpu_percent`, run side by
  side within their share; `gpu_schedule.py`).
- A runtime opened with `framework=True` also pays the ML framework's runtime (memory and
  initialisation, `DeviceSpec.framework_*`): a monolithic PyTorch function's runtime. The time the
  process has already spent starting (its real `import torch`) counts towards that initialisation.

Timed mode: a kernel is placed at issue on the device's compute units (`gpu_schedule.place_kernel`)
and never runs; events, stream synchronisation and pool frees take effect at modelled times, and a
caller that waits sleeps until then. Device allocations have addresses and are accounted exactly as
in functional mode but hold no host memory; copies move nothing (downloads fill the host with zeros);
`view` returns a `meta` tensor. An upload from pageable memory still pays the driver's staging on the
issuing thread, a real host memcpy overlapped with its modelled transfer (`pageable.py`), as the IO
daemon's pinned ring pays its own. A launch without `duration_s` lasts `spec.fallback_kernel_s`
(counted in `timed_stats()`).

Where it deliberately differs from CUDA:
- Errors are per stream, not sticky per context: a failing kernel (or a copy that finds its memory
  freed) is raised once by the next synchronize of its stream or of an event recorded after it, and
  the stream keeps running; other streams never see it. Closing a runtime drops unreported errors.
- `mem_free` is immediate and never synchronises the device; work still queued on that memory fails
  with `InvalidAddress` (copies) or `KernelError` (kernels that make their views when they run).
  A view made *before* the free and used after it cannot be detected (it keeps the bytes alive).
- Stream priority is stored only; copy engines are FIFO (as real copy engines ignore priority) and
  kernels are admitted to compute units first come, first served.
- Times are modelled for copies (exact link arithmetic) and real for kernels.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .address_space import ADDRESS_SPACE, Allocation, AllocationTable
from .base import (
    Backend,
    DeviceError,
    DeviceProperties,
    DeviceUsage,
    Event,
    HostBuffer,
    InvalidAddress,
    KernelError,
    KernelLaunch,
    MemoryPool,
    Runtime,
    Stream,
    TimelineRecord,
    aligned,
    contiguous_strides,
)
from .compute import ComputeStats, ComputeUnits, units_for
from .copy_engine import CopyEngine, CopyJob, sleep_until
from .emulated_pool import EmulatedPool
from .emulated_stream import EmulatedEvent, EmulatedStream
from .gpu_schedule import NEAR_KERNELS, Placed, place_kernel, place_kernel_near
from .host_backing import SpareBacking
from .ledger import Ledger, _process_start_time, default_state_dir, ledger_path
from .modes import check_device_mode, env_device_mode
from .pageable import PageableStager, transfer_floor
from .specs import V100_16GB, DeviceSpec, preset

DEFAULT_TIMELINE_LIMIT = 100_000

_runtime_ids = itertools.count(1)


class EmulatedHostBuffer(HostBuffer):
    """Host memory for copies. `pinned` only changes the modelled cost (allocation and bandwidth)."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self.nbytes = nbytes
        self.pinned = pinned
        self._data: torch.Tensor | None = torch.empty(nbytes, dtype=torch.uint8)

    def __repr__(self) -> str:
        return f"<EmulatedHostBuffer {self.nbytes} bytes {'pinned' if self.pinned else 'pageable'}>"

    def tensor(self) -> torch.Tensor:
        if self._data is None:
            raise DeviceError("host buffer has been freed")
        return self._data

    def free(self) -> None:
        self._data = None


def _host_bytes(obj: HostBuffer | torch.Tensor, what: str) -> tuple[torch.Tensor, bool]:
    """A flat uint8 view of a host buffer or CPU tensor, and whether it is pinned."""
    if isinstance(obj, HostBuffer):
        return obj.tensor(), obj.pinned
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise DeviceError(f"{what}: the emulated device copies only CPU tensors, got {obj.device}")
        if not obj.is_contiguous():
            raise ValueError(f"{what}: host tensor must be contiguous")
        return obj.reshape(-1).view(torch.uint8), False
    raise TypeError(f"{what}: expected a HostBuffer or a CPU tensor, got {type(obj).__name__}")


def _check_range(total: int, offset: int, nbytes: int, what: str) -> None:
    if nbytes < 0 or offset < 0:
        raise ValueError(f"{what}: negative size or offset ({nbytes}, {offset})")
    if offset + nbytes > total:
        raise ValueError(f"{what}: host range [{offset}, {offset + nbytes}) exceeds {total} bytes")


def _check_usable(alloc: Allocation, offset: int, what: str) -> None:
    """Raise if the memory was freed before the stream reached the operation."""
    if not alloc.usable:
        raise InvalidAddress(
            f"use after free: {what} at device address {alloc.start + offset:#x}: allocation "
            f"{alloc.start:#x} was {alloc.state.value} before the stream reached the copy"
        )


def _device_bytes(alloc: Allocation, offset: int, nbytes: int, what: str) -> torch.Tensor:
    """The bytes of a device range when the copy runs (the memory may have been freed meanwhile)."""
    _check_usable(alloc, offset, what)
    if alloc.data is None:
        raise InvalidAddress(f"{what}: allocation {alloc.start:#x} has no bytes (timed mode is phantom)")
    return alloc.data[offset : offset + nbytes]


_end = operator.itemgetter(1)  # a placed kernel's end: the key `_placed` is sorted by (C-level)


def _process_uptime() -> float:
    """Seconds since this process started (its interpreter start-up and imports included)."""
    ticks = _process_start_time(os.getpid())
    if not ticks or ticks < 0:
        return 0.0
    with open("/proc/uptime") as f:
        boot_uptime = float(f.read().split()[0])
    return max(0.0, boot_uptime - ticks / os.sysconf("SC_CLK_TCK"))


def framework_cost(spec: DeviceSpec) -> tuple[int, float]:
    """(bytes, seconds) of a framework runtime: the spec's, or `$STREAMBOX_FRAMEWORK_MEMORY` (bytes)
    and `$STREAMBOX_FRAMEWORK_INIT_S` when a run overrides them."""
    memory, init_s = spec.framework_memory, spec.framework_init_s
    for name, cast in (("STREAMBOX_FRAMEWORK_MEMORY", int), ("STREAMBOX_FRAMEWORK_INIT_S", float)):
        raw = os.environ.get(name, "").strip()
        if raw:
            try:
                value = cast(raw)
            except ValueError:
                raise ValueError(f"${name}={raw!r}: expected a {cast.__name__} >= 0") from None
            if value < 0:
                raise ValueError(f"${name}={raw!r}: expected a {cast.__name__} >= 0")
            memory, init_s = (value, init_s) if cast is int else (memory, value)
    return memory, init_s


class EmulatedRuntime(Runtime):
    """One context on one emulated device. Made by `EmulatedBackend.open_runtime`."""

    def __init__(
        self,
        backend: EmulatedBackend,
        index: int,
        ledger: Ledger,
        *,
        timeline: bool = True,
        timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
        mode: str = "functional",
        gpu_percent: int | None = None,
        framework_memory: int = 0,
    ) -> None:
        self.index = index
        self.spec: DeviceSpec = backend.spec
        self.backend = backend
        self.mode = check_device_mode(mode)
        self.timed = mode == "timed"
        self.gpu_percent = gpu_percent
        # MPS limits a client to its share of the SMs; without MPS a context may use them all.
        self.units = (
            self.spec.compute_units
            if gpu_percent is None
            else max(1, round(self.spec.compute_units * gpu_percent / 100))
        )
        self.framework_memory = framework_memory
        self.id = next(_runtime_ids)
        self.name_tag = f"d{index}-r{self.id}"
        self._ledger = ledger
        overhead = self.spec.context_memory + framework_memory
        self._slot = ledger.acquire_slot(self.id, overhead)
        self._lock = threading.RLock()
        self._closed = False
        self._allocated = overhead
        self._placed: list[Placed] = []  # timed mode: this context's kernels not yet ended
        self._longest = 0.0  # timed mode: the longest kernel placed so far (`place_kernel_near`)
        self._place_lock = threading.Lock()
        self._timed_kernels = 0
        self._fallback_kernels = 0
        self._kernel_seconds = 0.0
        self._table = AllocationTable()
        self._spare = SpareBacking()  # functional mode: released host backing, reused (host_backing.py)
        self._pools: set[EmulatedPool] = set()
        self._streams: dict[int, EmulatedStream] = {}
        self._all_streams: list[EmulatedStream] = []  # destroyed ones too, to join at close
        self._stream_ids = itertools.count()
        self._compute = ComputeUnits(self.units)
        self._timeline_on = timeline
        # Records, or for timed kernels their fields as a plain tuple (built into records on read:
        # a frozen dataclass costs about a microsecond to make, once per kernel).
        self._timeline: deque[TimelineRecord | tuple] = deque(maxlen=timeline_limit)
        self._stager = PageableStager()  # timed mode: the driver's staging of pageable uploads
        self._h2d = CopyEngine("h2d", f"streambox-emu-{self.name_tag}-h2d", self._record, ledger.link("h2d"))
        self._d2h = CopyEngine("d2h", f"streambox-emu-{self.name_tag}-d2h", self._record, ledger.link("d2h"))
        self._peer = CopyEngine("peer", f"streambox-emu-{self.name_tag}-peer", self._record)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._allocated} bytes"
        return f"<EmulatedRuntime {self.name_tag} {self.spec.name} {state}>"

    # -- internals shared with streams and pools -------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(f"runtime {self.name_tag} is closed")

    def own_stream(self, stream: Stream) -> EmulatedStream:
        if not isinstance(stream, EmulatedStream) or stream.runtime is not self:
            raise DeviceError(f"{stream!r} is not a stream of runtime {self.name_tag}")
        return stream

    def reserve(self, nbytes: int, owner: object = None) -> Allocation:
        """Reserve device memory (counted in the ledger) backed by a fresh host tensor."""
        self._check_open()
        size = aligned(nbytes)
        self._ledger.reserve(self._slot, self.id, size)
        try:
            data = None if self.timed else self._spare.take(size)
        except (RuntimeError, MemoryError) as exc:
            self._ledger.release(self._slot, self.id, size)
            raise DeviceError(f"host memory backing {size} device bytes could not be allocated") from exc
        alloc = Allocation(ADDRESS_SPACE.reserve(size), size, data, owner)
        self._table.insert(alloc)
        with self._lock:
            self._allocated += size
        return alloc

    def release(self, alloc: Allocation) -> None:
        """Give an allocation back to the device. Its address stays dead forever."""
        data = alloc.data
        self._table.remove(alloc.start)
        if data is not None and not self._closed:
            self._spare.give(data)
        self._ledger.release(self._slot, self.id, alloc.size)
        with self._lock:
            self._allocated -= alloc.size

    def forget_stream(self, stream: EmulatedStream) -> None:
        with self._lock:
            if self._streams.pop(stream.id, None) is not None:
                self._ledger.add_streams(self._slot, self.id, -1)

    def forget_pool(self, pool: EmulatedPool) -> None:
        with self._lock:
            self._pools.discard(pool)

    def sync_point(self) -> None:
        """A stream or event synchronize: pools give back cached memory above their threshold."""
        with self._lock:
            pools = list(self._pools)
        for pool in pools:
            pool.apply_release_threshold()

    def _record(self, record: TimelineRecord) -> None:
        if self._timeline_on:
            self._timeline.append(record)

    # -- properties -------------------------------------------------------------------------
    def properties(self) -> DeviceProperties:
        link = self.spec.link
        return DeviceProperties(
            index=self.index,
            name=self.spec.name,
            total_memory=self.spec.total_memory,
            compute_units=self.spec.compute_units,
            backend="emulated",
            extra={
                "link": link,
                "mode": self.mode,
                "context_memory": self.spec.context_memory,
                "context_create_s": self.spec.context_create_s,
                "framework_memory": self.framework_memory,
                "gpu_percent": self.gpu_percent,
                "compute_units_usable": self.units,
                "ledger": str(self._ledger.path),
                "runtime_id": self.id,
            },
        )

    def memory_info(self) -> tuple[int, int]:
        usage = self._ledger.usage()
        return usage.total_memory - usage.used_memory, usage.total_memory

    def allocated_bytes(self) -> int:
        with self._lock:
            return self._allocated

    # -- memory -----------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        return self.reserve(nbytes).start

    def mem_free(self, address: int) -> None:
        alloc = self._table.get(address)
        if alloc is None:
            self._table.remove(address)  # raises InvalidAddress: double free or not an allocation
        elif alloc.owner is not None:
            raise InvalidAddress(
                f"device address {address:#x} belongs to a memory pool: free it with free_async"
            )
        else:
            self.release(alloc)

    def create_pool(self, release_threshold: int = 0) -> MemoryPool:
        self._check_open()
        pool = EmulatedPool(self, release_threshold)
        with self._lock:
            self._pools.add(pool)
        return pool

    def host_alloc(self, nbytes: int, pinned: bool = True) -> HostBuffer:
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        if pinned:
            time.sleep(nbytes * self.spec.link.pinned_alloc_s_per_byte)
        return EmulatedHostBuffer(nbytes, pinned)

    # -- streams and events -----------------------------------------------------------------
    def create_stream(self, priority: int = 0) -> Stream:
        with self._lock:
            self._check_open()
            stream = EmulatedStream(self, next(self._stream_ids), priority)
            self._streams[stream.id] = stream
            self._all_streams.append(stream)
            self._ledger.add_streams(self._slot, self.id, 1)
        return stream

    def create_event(self, timing: bool = True) -> Event:
        self._check_open()
        return EmulatedEvent(self, timing)

    # -- copies -----------------------------------------------------------------------------
    def copy_htod_async(
        self, dst: int, src: HostBuffer | torch.Tensor, nbytes: int, stream: Stream, src_offset: int = 0
    ) -> None:
        self._check_open()
        s = self.own_stream(stream)
        host, pinned = _host_bytes(src, "htod copy source")
        _check_range(host.numel(), src_offset, nbytes, "htod copy source")
        alloc, offset = self._table.resolve(dst, nbytes, "htod copy")
        source = host[src_offset : src_offset + nbytes]
        cost = self.spec.link.copy_seconds(nbytes, pinned)
        issued_at = None
        if not pinned and not self.timed:
            source = source.clone()  # pageable memory is staged by the driver at issue
        elif not pinned:  # timed: no bytes move, but the driver's staging memcpy is real host work
            issued_at = time.perf_counter()
            staged, last = self._stager.stage(source)
            issued_at = transfer_floor(issued_at, staged, cost, last / self.spec.link.pageable_bandwidth)

        def run() -> None:
            if self.timed:
                _check_usable(alloc, offset, "htod copy")
            else:
                _device_bytes(alloc, offset, nbytes, "htod copy").copy_(source)

        s.enqueue_copy(self._h2d, CopyJob("htod", f"htod {s.lane}", nbytes, cost, 0.0, run), issued_at)

    def copy_dtoh_async(
        self, dst: HostBuffer | torch.Tensor, src: int, nbytes: int, stream: Stream, dst_offset: int = 0
    ) -> None:
        self._check_open()
        s = self.own_stream(stream)
        host, pinned = _host_bytes(dst, "dtoh copy destination")
        _check_range(host.numel(), dst_offset, nbytes, "dtoh copy destination")
        alloc, offset = self._table.resolve(src, nbytes, "dtoh copy")
        target = host[dst_offset : dst_offset + nbytes]

        def run() -> None:
            if self.timed:
                _check_usable(alloc, offset, "dtoh copy")
                target.zero_()  # phantom data: a download reads zeros
            else:
                target.copy_(_device_bytes(alloc, offset, nbytes, "dtoh copy"))

        cost = self.spec.link.copy_seconds(nbytes, pinned)
        s.enqueue_copy(self._d2h, CopyJob("dtoh", f"dtoh {s.lane}", nbytes, cost, 0.0, run))

    def copy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        self._check_open()
        s = self.own_stream(stream)
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        dst_alloc, dst_off = self._table.resolve(dst, nbytes, "dtod copy destination")
        src_alloc, src_off = self._table.resolve(src, nbytes, "dtod copy source")
        cost = nbytes / self.spec.link.device_bandwidth

        def run(ready: float) -> float:
            if self.timed:
                _check_usable(src_alloc, src_off, "dtod copy source")
                _check_usable(dst_alloc, dst_off, "dtod copy destination")
            else:
                source = _device_bytes(src_alloc, src_off, nbytes, "dtod copy source")
                target = _device_bytes(dst_alloc, dst_off, nbytes, "dtod copy destination")
                if dst_alloc is src_alloc and abs(dst_off - src_off) < nbytes:
                    source = source.clone()  # overlapping ranges: memmove semantics
                target.copy_(source)
            end = ready + cost
            if not self.timed:
                sleep_until(end)
            self._record(TimelineRecord(s.lane, "dtod", f"dtod {s.lane}", ready, end, nbytes))
            return end

        s.enqueue(run, inline=True)

    def copy_peer_async(self, dst: int, dst_runtime: Runtime, src: int, nbytes: int, stream: Stream) -> None:
        self._check_open()
        s = self.own_stream(stream)
        if not isinstance(dst_runtime, EmulatedRuntime):
            raise DeviceError(f"peer copy to a {type(dst_runtime).__name__}: both must be emulated")
        dst_runtime._check_open()
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        dst_alloc, dst_off = dst_runtime._table.resolve(dst, nbytes, "peer copy destination")
        src_alloc, src_off = self._table.resolve(src, nbytes, "peer copy source")

        def run() -> None:
            if self.timed or dst_runtime.timed:
                _check_usable(src_alloc, src_off, "peer copy source")
                _check_usable(dst_alloc, dst_off, "peer copy destination")
                return
            source = _device_bytes(src_alloc, src_off, nbytes, "peer copy source")
            _device_bytes(dst_alloc, dst_off, nbytes, "peer copy destination").copy_(source)

        cost = self.spec.link.peer_seconds(nbytes)
        name = f"peer {s.lane} -> d{dst_runtime.index}"
        s.enqueue_copy(self._peer, CopyJob("peer", name, nbytes, cost, 0.0, run))

    # -- kernels ----------------------------------------------------------------------------
    def launch(
        self,
        stream: Stream,
        kernel: Callable[[], object],
        *,
        blocks: int = 1,
        cu_cap: int | None = None,
        name: str = "kernel",
        duration_s: float | None = None,
    ) -> None:
        # `_check_open`, `own_stream` and `units_for` inlined on the common path (once per kernel)
        if self._closed:
            self._check_open()
        s = stream if type(stream) is EmulatedStream and stream._runtime is self else self.own_stream(stream)
        if cu_cap is None and blocks >= 1:
            units = blocks if blocks < self.units else self.units
        else:
            units = units_for(blocks, cu_cap, self.units)
        if self.timed:
            item = (min(blocks, self.spec.compute_units), units, name, self._duration(name, duration_s),
                    duration_s is None)

            def place(ready: float) -> float:
                now = time.perf_counter()
                with self._place_lock:
                    placed = self._place_locked(self._place_busy, ready, now, *item)
                self._account_placed(s, name, placed)
                return placed[1]

            s.enqueue(place, inline=True)
            return

        def run(ready: float) -> float:
            return self._run_kernel(s, kernel, units, name)

        s.enqueue(run)

    def launch_many(self, stream: Stream, launches: Sequence[KernelLaunch]) -> None:
        """One operation of `stream` for all of `launches` (one lock, one queue entry; in timed mode one
        placement transaction on the device ledger, each kernel placed after the one before it, as
        the stream would), instead of one per kernel: a plan's run issued a segment at a time."""
        if self._closed:
            self._check_open()
        s = stream if type(stream) is EmulatedStream and stream._runtime is self else self.own_stream(stream)
        capacity = self.units
        units = [  # `units_for`, inlined on the common path as in `launch`
            (blocks if blocks < capacity else capacity) if cu_cap is None and blocks >= 1
            else units_for(blocks, cu_cap, capacity)
            for _, blocks, cu_cap, _, _ in launches
        ]
        if self.timed:
            full_max, inf = self.spec.compute_units, math.inf
            duration_of = self._duration
            items = [  # `_duration`, inlined for a valid duration
                (blocks if blocks < full_max else full_max, want, name,
                 seconds if seconds is not None and 0.0 <= seconds < inf else duration_of(name, seconds),
                 seconds is None)
                for (_, blocks, _, name, seconds), want in zip(launches, units, strict=True)
            ]

            def place_all(ready: float) -> float:
                now = time.perf_counter()
                accounts: list[tuple[int, str, float]] = []
                placed: list[Placed] = []
                place_locked, mps = self._place_locked, self.gpu_percent is not None
                with self._place_lock, self._ledger.busy_batch(self._slot, mps) as batch:
                    place, end = batch.place, ready  # this lock order, as `place` nests them
                    for item in items:
                        one = place_locked(place, end, now, *item)
                        end = one[1]
                        accounts.append((one[2], item[2], end - one[0]))
                        placed.append(one)
                self._compute.account_many(accounts)
                if self._timeline_on:
                    lane = s.lane
                    self._timeline.extend(
                        (lane, "kernel", item[2], *one[:2], 0, one[2])
                        for item, one in zip(items, placed, strict=True)
                    )
                return end

            s.enqueue(place_all, inline=True)
            return
        kernels = [(launch[0], want, launch[3]) for launch, want in zip(launches, units, strict=True)]

        def run_all(ready: float) -> float:
            end, failures = ready, []
            for kernel, units, name in kernels:
                try:
                    end = self._run_kernel(s, kernel, units, name)
                except KernelError as exc:  # the rest still run, as separate launches would
                    failures.append(exc)
            if failures:
                if len(failures) > 1:
                    more = len(failures) - 1
                    kernels_word = "kernels" if more > 1 else "kernel"
                    failures[0].add_note(f"{more} more {kernels_word} of this launch failed after it")
                raise failures[0]
            return end

        s.enqueue(run_all)

    def _run_kernel(self, s: EmulatedStream, kernel: Callable[[], object], units: int, name: str) -> float:
        """Functional mode, on the stream's worker: run `kernel` on `units` compute units; its end."""
        self._compute.acquire(units)
        start = time.perf_counter()
        error: Exception | None = None
        try:
            kernel()
        except Exception as exc:
            error = exc
        finally:
            end = time.perf_counter()
            self._compute.release(units, name, end - start, failed=error is not None)
            self._record(TimelineRecord(s.lane, "kernel", name, start, end, 0, units))
        if error is not None:
            raise KernelError(
                name, f"kernel {name!r} failed on {s.lane}: {type(error).__name__}: {error}"
            ) from error
        return end

    def _duration(self, name: str, duration_s: float | None) -> float:
        """Timed mode: a kernel's modelled time, the spec's fallback when it has none."""
        if duration_s is None:
            return self.spec.fallback_kernel_s
        if duration_s < 0 or not math.isfinite(duration_s):
            raise ValueError(f"kernel {name!r}: duration_s must be a finite number >= 0, got {duration_s}")
        return duration_s

    def _place_busy(self, ready: float, now: float, fit: Callable[..., Placed], *fit_args: object) -> Placed:
        """One kernel's placement on the device ledger, in a transaction of its own."""
        return self._ledger.place_busy(self._slot, self.gpu_percent is not None, ready, now, fit, *fit_args)

    def _place_locked(
        self,
        place_busy: Callable[..., Placed],
        ready: float,
        now: float,
        full: int,
        want: int,
        name: str,
        duration: float,
        fallback: bool,
    ) -> Placed:
        """Timed mode: place one kernel that may start at `ready` among this context's own kernels
        and, through `place_busy` (the device ledger: `_place_busy`, or a `BusyBatch`'s), every other
        context's; `_place_lock` held."""
        placed = self._placed  # sorted by end: what ends before `ready` cannot matter
        if placed and placed[0][1] <= now:
            del placed[: bisect.bisect_right(placed, now, key=_end)]
        own = placed[bisect.bisect_right(placed, ready, key=_end) :] if placed else ()
        if len(own) <= NEAR_KERNELS:  # the common case: a short backlog, the search as is
            start, end, units = place_busy(
                ready, now, place_kernel, ready, duration, full, want, self.units, own
            )
        else:  # a long backlog (a host far ahead of the device): the near search first
            start, end, units = place_busy(
                ready, now, place_kernel_near, self._longest, ready, duration, full, want, self.units, own
            )
        bisect.insort(placed, (start, end, units), key=_end)
        if end - start > self._longest:
            self._longest = end - start
        self._timed_kernels += 1
        self._fallback_kernels += fallback
        self._kernel_seconds += end - start
        return start, end, units

    def _account_placed(self, s: EmulatedStream, name: str, placed: Placed) -> None:
        start, end, units = placed
        self._compute.account(units, name, end - start)
        if self._timeline_on:
            self._timeline.append((s.lane, "kernel", name, start, end, 0, units))

    def timed_stats(self) -> dict[str, float]:
        """Timed mode: kernels placed, those that had no `duration_s` (placed at the fallback
        duration), the modelled seconds they occupy the GPU (summed over kernels), and the bytes of
        pageable uploads staged on the host with the host seconds it took (`pageable.py`)."""
        with self._place_lock:
            return {
                "kernels": self._timed_kernels,
                "fallback_kernels": self._fallback_kernels,
                "fallback_kernel_s": self.spec.fallback_kernel_s,
                "kernel_seconds": self._kernel_seconds,
                "pageable_staged_bytes": self._stager.staged_bytes,
                "pageable_staging_s": self._stager.staging_seconds,
            }

    def view(
        self,
        address: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        itemsize = dtype.itemsize
        numel = math.prod(shape)
        if strides is None:
            span = numel
        else:
            strides = tuple(int(st) for st in strides)
            if len(strides) != len(shape) or any(st < 0 for st in strides):
                raise ValueError(f"strides {strides} do not fit shape {shape}")
            span = 0 if numel == 0 else 1 + sum((d - 1) * st for d, st in zip(shape, strides, strict=True))
        nbytes = span * itemsize
        alloc, offset = self._table.resolve(address, nbytes, "view")
        if self.timed:  # phantom data: the shape and layout without bytes
            _check_usable(alloc, offset, "view")
            layout = strides if strides is not None else contiguous_strides(shape)
            return torch.empty_strided(shape, layout, dtype=dtype, device="meta")
        if offset % itemsize:
            raise InvalidAddress(
                f"view at device address {address:#x} is misaligned for {dtype} ({itemsize} bytes)"
            )
        if alloc.data is None or not alloc.usable:
            _device_bytes(alloc, offset, nbytes, "view")  # raises the use-after-free error
        if strides is None:
            strides = contiguous_strides(shape)
        return alloc.typed_data(dtype).as_strided(shape, strides, offset // itemsize)

    # -- introspection ----------------------------------------------------------------------
    def timeline(self) -> list[TimelineRecord]:
        return [TimelineRecord(*r) if type(r) is tuple else r for r in list(self._timeline)]

    def set_timeline(self, enabled: bool) -> None:
        self._timeline_on = enabled

    def clear_timeline(self) -> None:
        self._timeline.clear()

    def compute_stats(self) -> ComputeStats:
        return self._compute.stats()

    def copy_engine_stats(self) -> dict[str, dict[str, float]]:
        """Per engine lane: copies served, bytes moved, modelled busy seconds, and of the copies those
        placed whole at issue (timed mode, `copy_engine.SHORT_COPY_S`)."""
        return {
            engine.lane: {
                "copies": engine.link.copies,
                "nbytes": engine.link.nbytes,
                "busy_seconds": engine.link.busy_seconds,
                "placed_at_issue": engine.placed_at_issue,
            }
            for engine in (self._h2d, self._d2h, self._peer)
        }

    def streams(self) -> list[Stream]:
        with self._lock:
            return list(self._streams.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streams = list(self._all_streams)
        for stream in streams:  # queued work runs to the end; its errors are dropped
            stream.stop()
        for engine in (self._h2d, self._d2h, self._peer):
            engine.stop()
        if streams:  # timed mode: placed work ends in modelled time, and so does the context
            sleep_until(max(stream.tail for stream in streams))
        for pool in list(self._pools):
            pool.destroy()
        for alloc in self._table.all():
            self.release(alloc)
        self._spare.clear()
        self._ledger.release_slot(self._slot, self.id)
        with self._lock:
            self._streams.clear()
            self._allocated = 0
        self.backend._forget(self)


class EmulatedBackend(Backend):
    """`count` emulated GPUs of one `spec`, shared with every process using the same `state_dir`."""

    name = "emulated"

    def __init__(
        self,
        spec: DeviceSpec | str = V100_16GB,
        count: int = 1,
        state_dir: str | Path | None = None,
        *,
        timeline: bool = True,
        timeline_limit: int = DEFAULT_TIMELINE_LIMIT,
        mode: str | None = None,
        framework: bool = False,
    ) -> None:
        if count < 1:
            raise ValueError(f"need at least one device, got {count}")
        self.mode = env_device_mode() if mode is None else check_device_mode(mode, "EmulatedBackend mode")
        self.framework = framework
        self.spec = preset(spec) if isinstance(spec, str) else spec
        self.count = count
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.timeline = timeline
        self.timeline_limit = timeline_limit
        self._runtimes: set[EmulatedRuntime] = set()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<EmulatedBackend {self.count} x {self.spec.name} {self.mode} state={self.state_dir}>"

    def ledger(self, index: int) -> Ledger:
        if not 0 <= index < self.count:
            raise DeviceError(f"no emulated device {index}: this backend has {self.count}")
        path = ledger_path(self.state_dir, index, self.spec.name, self.spec.total_memory)
        return Ledger.open(path, self.spec.total_memory)

    def device_count(self) -> int:
        return self.count

    def device_usage(self) -> list[DeviceUsage]:
        usages = []
        for index in range(self.count):
            u = self.ledger(index).usage()
            usages.append(
                DeviceUsage(index, self.spec.name, u.used_memory, u.total_memory, u.streams, u.runtimes)
            )
        return usages

    def open_runtime(
        self, index: int = 0, *, gpu_percent: int | None = None, framework: bool | None = None
    ) -> EmulatedRuntime:
        """A context on device `index`: `context_create_s` and `context_memory`, plus the framework's
        runtime when `framework` (default: the backend's). `gpu_percent`: an MPS client limited to
        that share of the compute units (its kernels run beside other MPS clients' instead of
        time-slicing with them)."""
        if gpu_percent is not None and not (isinstance(gpu_percent, int) and 1 <= gpu_percent <= 100):
            raise ValueError(f"gpu_percent must be an integer from 1 to 100, got {gpu_percent!r}")
        ledger = self.ledger(index)
        framework = self.framework if framework is None else framework
        framework_memory, framework_init_s = framework_cost(self.spec) if framework else (0, 0.0)
        # The process's real start-up (interpreter, `import torch`) is part of the framework's
        # initialisation: only the rest is modelled, so the import is not counted twice.
        modelled_init = max(0.0, framework_init_s - _process_uptime()) if framework else 0.0
        time.sleep(self.spec.context_create_s + modelled_init)
        runtime = EmulatedRuntime(
            self,
            index,
            ledger,
            timeline=self.timeline,
            timeline_limit=self.timeline_limit,
            mode=self.mode,
            gpu_percent=gpu_percent,
            framework_memory=framework_memory,
        )
        with self._lock:
            self._runtimes.add(runtime)
        return runtime

    def runtimes(self) -> list[EmulatedRuntime]:
        with self._lock:
            return list(self._runtimes)

    def _forget(self, runtime: EmulatedRuntime) -> None:
        with self._lock:
            self._runtimes.discard(runtime)

    def close(self) -> None:
        """Close every runtime this backend opened and is still open."""
        for runtime in self.runtimes():
            runtime.close()

    def __enter__(self) -> EmulatedBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
