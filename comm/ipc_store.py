"""Stream-only's data path: CUDA-IPC style PUT/GET with no managed store (the paper's Table 2).

What a stream-only function does with CUDA IPC, transfer by transfer:
- PUT: a fresh device allocation outside the memory pool (cudaMalloc: the runtime's `mem_alloc`, its
  host cost paid), a copy of the producer's bytes into it on the producer's stream (the device's copy
  engines take copies first come, first served), and an exported handle (cuIpcGetMemHandle). When the
  GPU has no room, the bytes go to pageable host memory instead.
- GET: opens the handle (cuIpcOpenMemHandle) and reads the bytes where they are; data in host memory
  (or on another GPU) is copied into a fresh allocation on the reader's GPU, paying the link.
- release: closes the handle (cuIpcCloseMemHandle); an allocation is freed (cudaFree) once its key has
  left and no reader holds it, after the readers' work.
No pressure awareness and no adaptive movement: data stays where its PUT placed it.

Costs: copies cost what the device says (the emulated link model, or the GPU). The host calls cost what
`IpcCosts` says, busy-waited on the calling thread, and are **modelled**: export/open/close are
`comm.baselines.CudaIpcModel`'s assumed constants (see there); cudaMalloc and cudaFree 50 us each, an
order of magnitude from https://www.cs.virginia.edu/~mwb7w/cuda_support/memory_management_overhead.html
(~50 us per cudaMalloc of 4 KB to 512 KB, more above, on an older GPU; cudaFree assumed alike). The
emulated `mem_alloc` itself is free, so without them a stream-only PUT would allocate for nothing.

Consumption, TTL, quotas and `watch` follow `CommStore` (docs/comm.md). Expiry is checked on each call
(no ticker: nothing here runs in the background).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from streambox.device import Event, OutOfDeviceMemory, Runtime, Stream

from . import quota
from .baselines import CudaIpcModel, busy_wait
from .config import StoreConfig
from .errors import CommError, GetTimeout, KeyExists, StoreClosed
from .lease import DeviceTensorLike, Lease, StoreStats, Transport, location_name, span_bytes
from .store_protocol import PutWatchers, check_put_args, tensor_layout
from .tables import HOST, Location, dtype_name

#: Keys remembered after they left, to say why in a GET timeout.
GONE_MEMORY = 10_000


@dataclass(frozen=True)
class IpcCosts:
    """Host time of the driver calls of one transfer (modelled: see the module doc)."""

    ipc: CudaIpcModel = CudaIpcModel()
    malloc_s: float = 50e-6
    free_s: float = 50e-6

    @property
    def label(self) -> str:
        return (
            f"{self.ipc.label}; cudaMalloc {self.malloc_s * 1e6:g} us + cudaFree {self.free_s * 1e6:g} us "
            f"(modelled)"
        )


@dataclass
class IpcStoreStats(StoreStats):
    spills: int = 0  # PUTs that found the GPU full and went to host memory
    spilled_bytes: int = 0
    device_allocs: int = 0  # fresh device allocations (PUT copies, readers' copies), outside the pool
    device_alloc_bytes: int = 0
    device_frees: int = 0
    modelled_host_s: dict[str, float] = field(default_factory=dict)  # busy-waited, by call


@dataclass(eq=False)
class _Block:
    """One allocation: device memory of a GPU (`address`), or host memory (`host`, device HOST)."""

    device: int
    address: int
    host: torch.Tensor | None
    nbytes: int
    stored: bool  # a key's bytes (counted in `usage`), not a reader's private copy
    leases: int = 0
    retired: bool = False  # no key refers to it: freed once the last lease goes
    waits: list[Event] = field(default_factory=list)  # readers' release events
    charge: tuple[str | None, int] | None = None  # a removed key's writer and bytes, released when freed


@dataclass(eq=False)
class _Entry:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int
    block: _Block
    reads_left: int | None
    expires_at: float | None
    ready: Event | None  # the copy into the block is done when it completes
    writer: str | None = None  # the function that PUT it (`quota.WriterTally`)


@dataclass(eq=False)
class _LeaseRecord:
    id: int
    block: _Block
    owner: str | None
    opened: bool  # an opened IPC handle (closed on release), else a private copy
    handle: weakref.ref[Lease] | None = None


class IpcStore:
    """CUDA-IPC style PUT/GET over the GPUs of one node (see the module doc); a `store_protocol.Store`."""

    def __init__(
        self,
        runtimes: Mapping[int, Runtime],
        *,
        node: str = "node0",
        config: StoreConfig | None = None,
        costs: IpcCosts | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not runtimes:
            raise ValueError("a store needs at least one GPU runtime")
        self.node = node
        self.config = config or StoreConfig()  # default_ttl_s, get_timeout_s, quota (PA, AM: unused)
        self.costs = costs or IpcCosts()
        self.clock = clock
        self._rt = dict(runtimes)
        # One copy stream per GPU: PUTs of CPU tensors and readers' copies, issued in order (FIFO).
        self._copy_streams = {g: rt.create_stream() for g, rt in self._rt.items()}
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[str, _Entry] = {}
        self._writers = quota.WriterTally()  # what each function's keys hold (`writer_share`)
        self._gone: dict[str, str] = {}
        self._leases: dict[int, _LeaseRecord] = {}
        self._lease_ids = itertools.count(1)
        self._watchers = PutWatchers(self._cond)
        self._unfreed: list[_Block] = []  # retired device blocks waiting for their readers' work
        self._used = dict.fromkeys(self._rt, 0)
        self._host_used = 0
        self._closed = False
        self.stats = IpcStoreStats()

    def __repr__(self) -> str:
        return f"<IpcStore {self.node} gpus={sorted(self._rt)} keys={len(self._entries)}>"

    # -- small parts --------------------------------------------------------------------------
    def runtime(self, gpu: int) -> Runtime:
        if gpu not in self._rt:
            raise ValueError(f"GPU {gpu} is not one of this store's GPUs {sorted(self._rt)}")
        return self._rt[gpu]

    def _charge(self, call: str, seconds: float) -> None:
        busy_wait(seconds)
        spent = self.stats.modelled_host_s
        spent[call] = spent.get(call, 0.0) + seconds

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"store {self.node} is closed")

    def keys(self) -> list[str]:
        self._expire()
        self._reap()
        with self._cond:
            return list(self._entries)

    def usage(self) -> dict[int, int]:
        """Stored bytes per GPU (HOST: host memory)."""
        with self._cond:
            return {**self._used, HOST: self._host_used}

    def snapshot(self) -> dict[str, Any]:
        """What a `stats` reply shows of the store (JSON-ready), in `CommStore.snapshot`'s shape."""
        held = self.usage()
        with self._cond:
            return {
                "gpus": sorted(self._rt),
                "held_bytes": {location_name(g): n for g, n in sorted(held.items())},
                "keys": len(self._entries),
                **asdict(self.stats),
            }

    def start(self) -> IpcStore:
        return self  # nothing runs in the background

    # -- allocation ---------------------------------------------------------------------------
    def _device_block(self, gpu: int, nbytes: int, stored: bool) -> _Block:
        """A fresh allocation outside the pool (raises OutOfDeviceMemory when the GPU is full)."""
        self._charge("malloc", self.costs.malloc_s)
        address = self._rt[gpu].mem_alloc(max(nbytes, 1))
        self.stats.device_allocs += 1
        self.stats.device_alloc_bytes += nbytes
        return _Block(gpu, address, None, nbytes, stored)

    def _retire(self, entry: _Entry) -> None:
        """No key refers to `entry`'s block (under the lock): it goes once its leases are back, after
        the PUT's copy into it."""
        block = entry.block
        if entry.ready is not None:
            block.waits.append(entry.ready)
        block.retired = True
        if block.leases == 0:
            self._unfreed.append(block)

    def _reap(self, wait: bool = False) -> None:
        """cudaFree the retired blocks whose readers' work is done (all of them with `wait`)."""
        with self._cond:
            due = [b for b in self._unfreed if wait or all(e.query() for e in b.waits)]
            self._unfreed = [b for b in self._unfreed if b not in due]
            for block in due:
                self._account(block, -1)
                if block.charge is not None:
                    self._writers.release(*block.charge)
        for block in due:
            if block.device == HOST:
                block.host = None
                continue
            for event in block.waits:
                event.synchronize()
            self._charge("free", self.costs.free_s)
            self._rt[block.device].mem_free(block.address)
            self.stats.device_frees += 1

    def _account(self, block: _Block, sign: int) -> None:
        if block.device == HOST:
            self._host_used += sign * block.nbytes
        elif block.stored:
            self._used[block.device] += sign * block.nbytes

    # -- PUT ------------------------------------------------------------------------------------
    def put(
        self,
        key: str,
        value: torch.Tensor | DeviceTensorLike,
        *,
        device: int | None = None,
        consumers: int | None = None,
        ttl: float | None = None,
        overwrite: bool = False,
        stream: Stream | None = None,
        writer: str | None = None,
    ) -> Location:
        """Copy `value` (a CPU tensor, or a device tensor of GPU `device` whose writes were issued to
        `stream`) into a fresh allocation and export it; to host memory when the GPU is full. The
        producer keeps its buffer. `writer`: the function that PUTs it (`quota.writer_share`)."""
        self._check_open()
        check_put_args(key, consumers)
        quota.check_ttl(self.config.quota, key, ttl)
        gpu = min(self._rt) if device is None else device
        self.runtime(gpu)
        self._expire()
        with self._cond:
            if key in self._entries and not overwrite:
                raise KeyExists(key)
        entry = self._copy_in(key, value, gpu, stream)
        ttl = ttl if ttl is not None else self.config.default_ttl_s
        entry.reads_left = consumers
        entry.expires_at = None if ttl is None or math.isinf(ttl) else self.clock() + ttl
        self._charge("export", self.costs.ipc.export_s)
        with self._cond:
            old = self._entries.get(key)
            try:
                if old is not None and not overwrite:
                    raise KeyExists(key)
                held = sum(self._used.values()) + self._host_used - (old.nbytes if old is not None else 0)
                mine = self._writers.usage(writer, entry.nbytes, (old.writer, old.nbytes) if old else None)
                usage = quota.Usage(held, len(self._entries) + (old is None), self._host_used, writer, *mine)
                quota.check_put(self.config.quota, key, entry.nbytes, usage)
            except CommError:
                self._retire(entry)
                raise
            if old is not None:
                self._remove(old, "overwritten")
            entry.writer = writer
            self._entries[key] = entry
            self._writers.add(writer, entry.nbytes)
            self._gone.pop(key, None)
            self.stats.puts += 1
            self._cond.notify_all()
            watchers = self._watchers.take(key)
        for callback in watchers:  # outside the lock: a callback may GET the key at once
            callback()
        self._reap()
        return self._location(entry)

    def _copy_in(
        self, key: str, value: torch.Tensor | DeviceTensorLike, gpu: int, stream: Stream | None
    ) -> _Entry:
        """The PUT's copy: device -> a fresh device allocation, or -> host memory when none fits."""
        rt = self._rt[gpu]
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise TypeError(f"PUT {key!r}: pass a CPU tensor or a device tensor, got {value.device}")
            value = value.detach().contiguous()
            n = value.numel() * value.element_size()
            shape, strides, dtype, src = tuple(value.shape), tuple(value.stride()), value.dtype, None
        else:
            src, dtype, shape, strides = tensor_layout(key, value)
            n = span_bytes(shape, strides, dtype.itemsize)
        on = stream if stream is not None and src is not None else self._copy_streams[gpu]
        try:
            block = self._device_block(gpu, n, stored=True)
        except OutOfDeviceMemory:
            block = self._host_block(key, n)
        if n:
            if src is None:  # a CPU tensor (pageable: staged when issued)
                flat = value.reshape(-1).view(torch.uint8)  # type: ignore[union-attr]
                if block.device == HOST:
                    block.host.copy_(flat)  # type: ignore[union-attr]
                else:
                    rt.copy_htod_async(block.address, flat, n, on)
            elif block.device == HOST:
                rt.copy_dtoh_async(block.host, src, n, on)  # type: ignore[arg-type]
            else:
                rt.copy_dtod_async(block.address, src, n, on)
        ready = rt.create_event(timing=False)
        ready.record(on)
        with self._cond:
            self._account(block, +1)
        return _Entry(key, dtype, shape, strides, n, block, None, None, ready)

    def _host_block(self, key: str, nbytes: int) -> _Block:
        with self._cond:
            if not quota.host_allows(self.config.quota, self._host_used, nbytes):
                raise quota.host_full(self.config.quota, key, self._host_used, nbytes)
        self.stats.spills += 1
        self.stats.spilled_bytes += nbytes
        return _Block(HOST, 0, torch.empty(nbytes, dtype=torch.uint8), nbytes, stored=True)

    def _location(self, entry: _Entry) -> Location:
        b = entry.block
        return Location(entry.key, self.node, b.device, b.address, entry.nbytes, dtype_name(entry.dtype),
                        entry.shape, entry.strides)

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` once after the next PUT of `key` (at once if it is here); returns a cancel."""
        return self._watchers.watch(key, callback, lambda: key in self._entries)

    # -- GET ------------------------------------------------------------------------------------
    def get(
        self, key: str, *, device: int | None = None, timeout: float | None = None, owner: str | None = None
    ) -> Lease:
        """Open the handle of `key` on GPU `device` (or copy host data there), waiting up to `timeout`."""
        self._check_open()
        gpu = min(self._rt) if device is None else device
        self.runtime(gpu)
        timeout = self.config.get_timeout_s if timeout is None else timeout
        deadline = self.clock() + timeout
        self._expire()
        with self._cond:
            while (entry := self._entries.get(key)) is None:
                self._check_open()
                now = self.clock()
                if now >= deadline:
                    raise GetTimeout(key, timeout, f"it was {self._gone[key]}" if key in self._gone
                                     else "never PUT as far as this node knows")
                self._cond.wait(deadline - now)
            src = entry.block
            src.leases += 1  # the reader's lease (or a pin while a copy reads it unlocked)
            if entry.reads_left is not None:
                entry.reads_left -= 1
                if entry.reads_left == 0:
                    self._remove(entry, "consumed by its declared consumers")
        if src.device == gpu:
            self._charge("open", self.costs.ipc.open_s)
            return self._lease(entry, src, owner, gpu, Transport.IPC, entry.ready, opened=True)
        try:
            block, ready = self._copy_out(entry, gpu)
        finally:
            with self._cond:
                self._drop(src)
        transport = Transport.HOST if src.device == HOST else Transport.PEER
        return self._lease(entry, block, owner, gpu, transport, ready, opened=False)

    def _copy_out(self, entry: _Entry, gpu: int) -> tuple[_Block, Event]:
        """A copy of `entry` in a fresh allocation on `gpu`, issued on the store's copy stream (FIFO)."""
        src, n, rt, stream = entry.block, entry.nbytes, self._rt[gpu], self._copy_streams[gpu]
        try:
            block = self._device_block(gpu, n, stored=False)
        except OutOfDeviceMemory as exc:
            where = "host memory" if src.device == HOST else f"GPU {src.device}"
            raise CommError(
                f"GET {entry.key!r}: its {n} bytes are in {where} and GPU {gpu} has no room to copy "
                f"them ({exc})"
            ) from None
        if src.device == HOST:
            if entry.ready is not None:
                entry.ready.synchronize()  # the PUT's device-to-host copy: pageable, done on the host
            if n:
                rt.copy_htod_async(block.address, src.host, n, stream)  # type: ignore[arg-type]
        else:  # a peer copy, issued on the source GPU's copy stream
            rt, stream = self._rt[src.device], self._copy_streams[src.device]
            if entry.ready is not None:
                stream.wait_event(entry.ready)
            if n:
                rt.copy_peer_async(block.address, self._rt[gpu], src.address, n, stream)
        ready = rt.create_event(timing=False)
        ready.record(stream)
        block.leases, block.retired = 1, True  # the reader's private copy: freed when its lease goes
        return block, ready

    def _lease(
        self,
        entry: _Entry,
        block: _Block,
        owner: str | None,
        gpu: int,
        transport: Transport,
        ready: Event | None,
        *,
        opened: bool,
    ) -> Lease:
        """The reader's handle on `block` (whose lease count already includes it)."""
        with self._cond:
            lease = _LeaseRecord(next(self._lease_ids), block, owner, opened)
            self._leases[lease.id] = lease
            self.stats.gets[transport.value] += 1
        handle = Lease(self, lease.id, entry.key, gpu, block.address, entry.dtype, entry.shape,  # type: ignore[arg-type]
                        entry.strides, entry.nbytes, transport, ready)
        lease.handle = weakref.ref(handle)
        return handle

    # -- release, delete, expiry ----------------------------------------------------------------
    def _drop(self, block: _Block) -> None:
        block.leases -= 1
        if block.leases == 0 and block.retired:
            self._unfreed.append(block)

    def _release_lease(self, lease_id: int, stream: Stream | None, device: int | None = None) -> None:
        event = None
        if stream is not None and device is not None and device != HOST:
            event = self._rt[device].create_event(timing=False)
            event.record(stream)
        with self._cond:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return
            if event is not None:
                lease.block.waits.append(event)
            self._drop(lease.block)
        if lease.opened:
            self._charge("close", self.costs.ipc.close_s)
        self._reap()

    def release_owner(self, owner: str) -> int:
        """Release every lease `owner` holds (its function instance died); returns how many."""
        with self._cond:
            mine = [lease for lease in self._leases.values() if lease.owner == owner]
            for lease in mine:
                del self._leases[lease.id]
                if lease.handle is not None and (h := lease.handle()) is not None:
                    h._expired()
                self._drop(lease.block)
        self._reap()
        return len(mine)

    def _remove(self, entry: _Entry, why: str) -> None:
        """Take `entry` out of the table (under the lock); its bytes go once unleased."""
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            self._writers.remove_key(entry.writer)
            entry.block.charge = (entry.writer, entry.nbytes)  # its writer's until freed (leases: later)
            self._gone[entry.key] = why
            if len(self._gone) > GONE_MEMORY:
                self._gone.pop(next(iter(self._gone)))
        self._retire(entry)

    def delete(self, key: str) -> bool:
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                self._remove(entry, "deleted")
        self._reap()
        return entry is not None

    def _expire(self) -> None:
        now = self.clock()
        with self._cond:
            late = [e for e in self._entries.values() if e.expires_at is not None and e.expires_at <= now]
            for entry in late:
                self._remove(entry, "expired (TTL)")
            self.stats.expired_keys += len(late)

    def close(self) -> None:
        """Free every byte the store holds (outstanding handles become invalid)."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            for entry in list(self._entries.values()):
                self._remove(entry, "dropped when the store closed")
            for lease in list(self._leases.values()):
                if lease.handle is not None and (h := lease.handle()) is not None:
                    h._expired()
                self._drop(lease.block)
            self._leases.clear()
            self._cond.notify_all()
        self._reap(wait=True)
        for stream in self._copy_streams.values():
            stream.synchronize()
            stream.destroy()

    def __enter__(self) -> IpcStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
