"""The communication store of one node: PUT/GET/DELETE by key over the node's GPUs (the proxy side).

The store is the thin shell around the pure rules of `policy.py` and the tables of `tables.py`:
it owns the bytes, a lock, one copy stream and one free stream per GPU, and an optional ticker thread.

Semantics (documented in docs/comm.md, pinned by tests/comm):
- `put(key, value, consumers=None, ttl=None, overwrite=False)`: a CPU tensor is uploaded to the
  producer's GPU (or wherever `policy.place` says); a device tensor (anything with address, dtype,
  shape, strides, nbytes: `api_proxy.device_tensor.DeviceTensor`) is *adopted* without a copy: the
  store owns those bytes from now on and frees them with the allocator of that GPU, which must be the
  one they came from. A PUT over a held key raises `KeyExists` unless `overwrite`.
- `get(key, device=..., timeout=...)` waits for the key (producer-consumer) and returns a `Lease`:
  on the data's GPU the handle *is* the stored memory (zero copy); from another GPU it is a peer copy
  into the reader's GPU; from host memory a host-to-device copy; from another node an RPC stream.
- Consumption: **a GET counts as one read of the key when it is served.** Once `consumers` reads have
  been served the key leaves the tables (later GETs wait, then time out naming the key) and its bytes
  are freed as soon as every handle on them is released. Handles are leases: `release(stream)` (or a
  `with` block) hands them back, stream-ordered; `release_owner(owner)` releases everything a dead
  function held; a lease older than `lease_ttl_s` is force-released. A key's TTL (`ttl`, else
  `default_ttl_s`) removes it even when some consumer never came.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from streambox.device import Event, HostBuffer, OutOfDeviceMemory, Runtime, Stream

from . import policy, quota
from .config import IdlePredictor, StoreConfig
from .errors import CommError, GetTimeout, KeyExists, StoreClosed
from .lease import (
    Allocator,
    DeviceTensorLike,
    Lease,
    StoreStats,
    Transport,
    count_into,
    location_name,
    span_bytes,
)
from .policy import HOST, GpuState, ItemState, Move
from .store_protocol import PutWatchers, check_put_args, tensor_layout
from .tables import GlobalTable, GlobalView, Location, NodeTable, dtype_name, parse_dtype

log = logging.getLogger(__name__)

#: Keys remembered after they left the store, to say why in a GET timeout.
GONE_MEMORY = 10_000


@dataclass(eq=False)
class _Buffer:
    """One physical copy: device memory of a GPU, or a host tensor."""

    device: int
    address: int
    host: torch.Tensor | None
    nbytes: int
    stored: bool  # counted in the store's usage; False for a reader's private copy
    leases: int = 0
    retired: bool = False  # no item refers to it any more: free once the last lease goes
    freed: bool = False
    waits: list[Event] = field(default_factory=list)  # readers' release events: the free waits on them
    charge: tuple[str | None, int] | None = None  # a removed key's writer and bytes, released when freed


@dataclass(eq=False)
class _Item:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    nbytes: int
    buffer: _Buffer
    reads_left: int | None
    expires_at: float | None
    seq: int
    ready: Event | None  # the producer's writes are done when this completes
    last_reader: int | None = None
    moving: bool = False
    writer: str | None = None  # the function that PUT it (`quota.WriterTally`)


@dataclass(eq=False)
class _LeaseRecord:
    id: int
    buffer: _Buffer
    owner: str | None
    deadline: float
    ready: Event | None
    handle: weakref.ref[Lease] | None = None


#: Idle memory per GPU: one predictor for all GPUs, a value or a predictor per GPU (e.g. the memory
#: pool's `memory_pool.idle.PoolIdleMemory` of that GPU's pool, or None for that GPU's observed free
#: memory: a neighbour GPU whose demand model lives in other processes), or None (observed, all GPUs).
IdleSource = IdlePredictor | Mapping[int, float | IdlePredictor | None] | None


class CommStore:
    """PUT/GET over the GPUs of one node. `runtimes` and `allocators` are keyed by GPU index."""

    def __init__(
        self,
        runtimes: Mapping[int, Runtime],
        allocators: Mapping[int, Allocator],
        *,
        node: str = "node0",
        idle: IdleSource = None,
        config: StoreConfig | None = None,
        global_table: GlobalTable | None = None,
        endpoint: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not runtimes:
            raise ValueError("a store needs at least one GPU runtime")
        if set(runtimes) != set(allocators):
            raise ValueError(
                f"runtimes for GPUs {sorted(runtimes)} but allocators for GPUs {sorted(allocators)}"
            )
        if any(g < 0 for g in runtimes):
            raise ValueError(f"GPU indices must be >= 0, got {sorted(runtimes)}")
        self.node = node
        self.config = config or StoreConfig()
        self.endpoint = endpoint
        self.clock = clock
        self._rt = dict(runtimes)
        self._alloc = dict(allocators)
        self._idle = self._idle_predictor(idle)
        self._copy_streams = {g: rt.create_stream() for g, rt in self._rt.items()}
        self._free_streams = {g: rt.create_stream() for g, rt in self._rt.items()}
        self._cond = threading.Condition(threading.Lock())  # never re-entered: the pool does not call up
        self._items: dict[str, _Item] = {}
        self._writers = quota.WriterTally()  # what each function's keys hold (`writer_share`)
        self.table = NodeTable(node)
        self._used = dict.fromkeys(self._rt, 0)
        self._host_used = 0
        self._leases: dict[int, _LeaseRecord] = {}
        # No item's or lease's deadline is earlier (one may be later: a hint, lowered as they come and
        # recomputed by the scan it lets through): the ticker's `expire` scans nothing before it.
        self._next_deadline = math.inf
        self._ticker_idle = True  # the ticker waits its idle period (`_tick_loop`)
        self._lease_ids = itertools.count(1)
        self._seq = itertools.count()
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._watchers = PutWatchers(self._cond)  # one-shot PUT notifications
        self._global = global_table
        self._view = GlobalView(node, self.config.global_refresh_s) if global_table is not None else None
        self._sync_lock = threading.Lock()
        self._move_lock = threading.Lock()  # one movement at a time (a move's allocation never reclaims)
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # ends the ticker's idle wait: data arrived (or `close`)
        self._closed = False
        self.stats = StoreStats()

    def __repr__(self) -> str:
        return f"<CommStore {self.node} gpus={sorted(self._rt)} keys={len(self._items)}>"

    # -- configuration ----------------------------------------------------------------------
    def _idle_predictor(self, idle: IdleSource) -> IdlePredictor:
        if idle is None:
            return self._observed_idle
        if callable(idle):
            return idle
        values = dict(idle)
        missing = sorted(set(self._rt) - set(values))
        if missing:
            raise ValueError(f"idle memory given for GPUs {sorted(values)}, missing {missing}")
        def per_gpu(gpu: int, now: float, window: float) -> float:
            value = values[gpu]
            if value is None:
                return self._observed_idle(gpu, now, window)
            return value(gpu, now, window) if callable(value) else value

        return per_gpu

    def _observed_idle(self, gpu: int, now: float, window: float) -> float:
        """Fallback when no demand model is wired: free device memory now plus the store's own bytes
        (observed, not predicted)."""
        free, _ = self._rt[gpu].memory_info()
        return free + self._used[gpu]

    @property
    def devices(self) -> list[int]:
        return sorted(self._rt)

    def runtime(self, gpu: int) -> Runtime:
        try:
            return self._rt[gpu]
        except KeyError:
            raise CommError(f"node {self.node} has no GPU {gpu}; it has {self.devices}") from None

    def _default_device(self, device: int | None) -> int:
        if device is None:
            return min(self._rt)
        self.runtime(device)
        return device

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"communication store of node {self.node} is closed")

    # -- state for the policy ---------------------------------------------------------------
    def capacities(self, now: float | None = None) -> dict[int, float]:
        """Bytes the store may hold on each GPU at `now`."""
        now = self.clock() if now is None else now
        cfg = self.config
        if not cfg.pressure_aware:
            return dict.fromkeys(self._rt, cfg.static_capacity)
        return {
            g: policy.store_capacity(self._idle(g, now, cfg.window_s), cfg.capacity_fraction)
            for g in self._rt
        }

    def _gpu_states(self, capacities: Mapping[int, float]) -> list[GpuState]:
        return [GpuState(g, capacities[g], self._used[g]) for g in sorted(self._rt)]

    @staticmethod
    def _item_state(item: _Item) -> ItemState:
        return ItemState(
            item.key,
            item.nbytes,
            item.buffer.device,
            item.seq,
            item.last_reader,
            movable=not item.moving and item.buffer.leases == 0,
        )

    def usage(self) -> dict[int, int]:
        """Bytes the store holds per GPU, and in host memory under `HOST` (-1). Lock-free (a copy of
        ints under the GIL; the keys never change): the idle-memory predictor asks for it while the
        store computes capacities under its lock."""
        return {**self._used, HOST: self._host_used}

    def location(self, key: str) -> Location | None:
        with self._cond:
            return self.table.get(key)

    def table_snapshot(self) -> dict[str, Location]:
        with self._cond:
            return self.table.snapshot()

    def keys(self) -> list[str]:
        with self._cond:
            return sorted(self._items)

    def held_leases(self) -> int:
        with self._cond:
            return len(self._leases)

    def snapshot(self) -> dict[str, Any]:
        """What a `stats` reply shows of the store (JSON-ready): its GPUs, the bytes it holds per
        location (`gpu<i>`, `host`), its keys and its counters (moves and copies by location)."""
        with self._cond:
            return {
                "gpus": self.devices,
                "held_bytes": {location_name(g): n for g, n in sorted(self.usage().items())},
                "keys": len(self._items),
                "adaptive_movement": self.config.adaptive_movement,
                "pressure_aware": self.config.pressure_aware,
                **asdict(self.stats),
            }

    # -- buffers ----------------------------------------------------------------------------
    def _account(self, device: int, nbytes: int) -> None:
        if device == HOST:
            self._host_used += nbytes
        else:
            self._used[device] += nbytes

    def _alloc_gpu(self, gpu: int, nbytes: int) -> int:
        return self._alloc[gpu].allocate(max(nbytes, 1), self._copy_streams[gpu])

    def _copy(self, src: _Buffer, dst_device: int, ready: Event | None, stored: bool) -> _Buffer:
        """A new buffer on `dst_device` (GPU or HOST) with the bytes of `src`; synchronous."""
        n = src.nbytes
        if dst_device == HOST:
            host = torch.empty(max(n, 1), dtype=torch.uint8)
            if src.device == HOST:
                assert src.host is not None
                host[:n].copy_(src.host[:n])
            elif n:
                stream = self._copy_streams[src.device]
                if ready is not None:
                    stream.wait_event(ready)
                self._rt[src.device].copy_dtoh_async(host, src.address, n, stream)
                stream.synchronize()
            return _Buffer(HOST, 0, host, n, stored)
        address = self._alloc_gpu(dst_device, n)
        try:
            if src.device == HOST:
                stream = self._copy_streams[dst_device]
                if n:
                    assert src.host is not None
                    self._rt[dst_device].copy_htod_async(address, src.host, n, stream)
            else:
                stream = self._copy_streams[src.device]
                if ready is not None:
                    stream.wait_event(ready)
                if n and src.device == dst_device:
                    self._rt[src.device].copy_dtod_async(address, src.address, n, stream)
                elif n:
                    peer = self._rt[dst_device]
                    self._rt[src.device].copy_peer_async(address, peer, src.address, n, stream)
            stream.synchronize()
        except BaseException:
            self._alloc[dst_device].free(address, self._copy_streams[dst_device])
            raise
        return _Buffer(dst_device, address, None, n, stored)

    def _copy_to_reader(self, src: _Buffer, gpu: int, ready: Event | None) -> _Buffer:
        """A private copy on the reader's GPU; on OOM, first move stored data off that GPU."""
        try:
            return self._copy(src, gpu, ready, stored=False)
        except OutOfDeviceMemory:
            if self.reclaim(gpu, src.nbytes) == 0:
                raise
            return self._copy(src, gpu, ready, stored=False)

    def _retire(self, buf: _Buffer) -> None:
        """No item refers to `buf` any more (under the lock): free it once its leases are gone."""
        buf.retired = True
        if buf.leases == 0:
            self._free(buf)

    def _free(self, buf: _Buffer) -> None:
        if buf.freed:
            return
        buf.freed = True
        if buf.charge is not None:
            self._writers.release(*buf.charge)
        if buf.stored:
            self._account(buf.device, -buf.nbytes)
        if buf.device == HOST:
            buf.host = None
            return
        stream = self._free_streams[buf.device]
        for event in buf.waits:
            stream.wait_event(event)
        buf.waits.clear()
        alloc = self._alloc[buf.device]
        alloc.free(buf.address, stream)
        # A pool that defers fences (DeviceMemoryPool) does so for the freeing stream to reuse its own
        # blocks; nothing allocates on a free stream, so fence now: the bytes are everyone's once the
        # stream gets here.
        fence = getattr(alloc, "fence", None)
        if fence is not None:
            fence(stream)

    # -- leases -----------------------------------------------------------------------------
    def _new_lease(self, buf: _Buffer, owner: str | None, ready: Event | None, now: float) -> _LeaseRecord:
        buf.leases += 1
        lease = _LeaseRecord(next(self._lease_ids), buf, owner, now + self.config.lease_ttl_s, ready)
        self._leases[lease.id] = lease
        self._next_deadline = min(self._next_deadline, lease.deadline)
        self._wake_ticker()
        return lease

    def _wake_ticker(self) -> None:
        """Something to expire or move exists now: the ticker leaves its idle period (lock held). A
        ticker already on its `tick_s` period is left to it: waking it per PUT and lease would run a
        round (the idle-memory prediction) per call, hundreds a second under load."""
        if self._ticker_idle and not self._wake.is_set():
            self._wake.set()

    def _drop_lease(self, lease: _LeaseRecord) -> None:
        buf = lease.buffer
        buf.leases -= 1
        if buf.leases == 0 and buf.retired:
            self._free(buf)

    def _release_lease(self, lease_id: int, stream: Stream | None, device: int | None = None) -> None:
        event = None
        if stream is not None and device is not None and device != HOST:
            event = self._rt[device].create_event(timing=False)
            event.record(stream)
        with self._cond:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return  # expired or released with its owner
            if event is not None:
                lease.buffer.waits.append(event)
            self._drop_lease(lease)
            self._cond.notify_all()

    def release_owner(self, owner: str) -> int:
        """Release every lease `owner` holds (its function instance died); returns how many."""
        with self._cond:
            mine = [lease for lease in self._leases.values() if lease.owner == owner]
            for lease in mine:
                del self._leases[lease.id]
                if lease.handle is not None and (h := lease.handle()) is not None:
                    h._expired()
                self._drop_lease(lease)
            return len(mine)

    def _handle(
        self, item: _Item, buf: _Buffer, lease: _LeaseRecord, gpu: int, transport: Transport
    ) -> Lease:
        handle = Lease(
            self, lease.id, item.key, gpu, buf.address, item.dtype, item.shape, item.strides,
            item.nbytes, transport, lease.ready,
        )
        lease.handle = weakref.ref(handle)
        return handle

    # -- PUT --------------------------------------------------------------------------------
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
        """Store `value` under `key`; see the module docstring. Returns where it landed.

        `device` is the producer's GPU (for a device tensor: the GPU holding it). `stream` is the
        producer's stream for a device tensor: readers wait for the work issued to it so far.
        `writer`: the function that PUTs it, held to its share of the quota (`quota.writer_share`).
        """
        self._check_open()
        check_put_args(key, consumers)
        quota.check_ttl(self.config.quota, key, ttl)
        gpu = self._default_device(device)
        with self._cond:
            if key in self._items and not overwrite:
                raise KeyExists(key)
        uploaded = isinstance(value, torch.Tensor)
        item = self._upload(key, value, gpu) if uploaded else self._adopt(key, value, gpu, stream)
        now = self.clock()
        ttl = ttl if ttl is not None else self.config.default_ttl_s
        item.reads_left = consumers
        item.expires_at = None if ttl is None or math.isinf(ttl) else now + ttl
        with self._cond:
            old = self._items.get(key)
            try:
                if old is not None and not overwrite:  # a concurrent PUT of the same key won the race
                    raise KeyExists(key)
                item.writer = writer
                self._check_quota(item, old)
            except CommError:
                if uploaded:
                    self._retire(item.buffer)
                else:
                    self._account(gpu, -item.nbytes)  # the adopted bytes stay the producer's
                raise
            if old is not None:
                self._remove(old, "overwritten")
            self._items[key] = item
            self._writers.add(writer, item.nbytes)
            if item.expires_at is not None:
                self._next_deadline = min(self._next_deadline, item.expires_at)
            self._wake_ticker()
            self._gone.pop(key, None)
            self.table.set(self._location(item))
            self.stats.puts += 1
            self._cond.notify_all()
            location = self.table.get(key)
            watchers = self._watchers.take(key)
        for callback in watchers:  # outside the lock: a callback may GET the key at once
            callback()
        return location  # type: ignore[return-value]

    def _check_quota(self, item: _Item, old: _Item | None) -> None:
        """`quota.check_put` of `item`'s PUT, its bytes counted and those of the key it overwrites
        (`old`) not; the lock held."""
        held = sum(self._used.values()) + self._host_used - (old.nbytes if old is not None else 0)
        mine = self._writers.usage(item.writer, item.nbytes, (old.writer, old.nbytes) if old else None)
        usage = quota.Usage(held, len(self._items) + (old is None), self._host_used, item.writer, *mine)
        quota.check_put(self.config.quota, item.key, item.nbytes, usage)

    def watch(self, key: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` once after the next PUT of `key` (on the putting thread; at once if the
        key is here now); returns a function that cancels it. The waiting of `get` for callers that
        must not block a thread (the proxy's dispatcher): the same PUT wakes both."""
        return self._watchers.watch(key, callback, lambda: key in self._items)

    def _upload(self, key: str, tensor: torch.Tensor, gpu: int) -> _Item:
        if tensor.device.type != "cpu":
            raise TypeError(f"PUT {key!r}: pass a CPU tensor or a device-tensor handle, got {tensor.device}")
        tensor = tensor.detach().contiguous()
        n = tensor.numel() * tensor.element_size()
        flat = tensor.reshape(-1).view(torch.uint8)
        source = _Buffer(HOST, 0, flat, n, stored=False)
        with self._cond:
            dst, _ = policy.place(n, gpu, self._gpu_states(self.capacities()), self.config.adaptive_movement)
            if dst == HOST and not quota.host_allows(self.config.quota, self._host_used, n):
                raise quota.host_full(self.config.quota, key, self._host_used, n)
            self._account(dst, n)  # reserve before the copy, so concurrent PUTs see it
        try:
            buf = self._copy(source, dst, None, stored=True)
        except OutOfDeviceMemory:
            with self._cond:
                self._account(dst, -n)
                if not quota.host_allows(self.config.quota, self._host_used, n):
                    raise quota.host_full(self.config.quota, key, self._host_used, n) from None
                self._account(HOST, n)
            dst = HOST
            buf = self._copy(source, HOST, None, stored=True)
        except BaseException:
            with self._cond:
                self._account(dst, -n)
            raise
        return _Item(key, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), n, buf, None, None,
                     next(self._seq), None)

    def _adopt(self, key: str, value: DeviceTensorLike, gpu: int, stream: Stream | None) -> _Item:
        address, dtype, shape, strides = tensor_layout(key, value)
        n = span_bytes(shape, strides, dtype.itemsize)
        ready = None
        if stream is not None:
            ready = self._rt[gpu].create_event(timing=False)
            ready.record(stream)
        with self._cond:
            self._account(gpu, n)
        buf = _Buffer(gpu, address, None, n, stored=True)
        return _Item(key, dtype, shape, strides, n, buf, None, None, next(self._seq), ready)

    def _location(self, item: _Item) -> Location:
        buf = item.buffer
        return Location(item.key, self.node, buf.device, buf.address, item.nbytes, dtype_name(item.dtype),
                        item.shape, item.strides)

    def _remove(self, item: _Item, why: str) -> None:
        """Take `item` out of the tables (under the lock); its bytes go once unleased."""
        if self._items.get(item.key) is item:
            del self._items[item.key]
            self._writers.remove_key(item.writer)
            item.buffer.charge = (item.writer, item.nbytes)  # its writer's until freed (leases: later)
            self.table.remove(item.key)
            self._gone[item.key] = why
            self._gone.move_to_end(item.key)
            while len(self._gone) > GONE_MEMORY:
                self._gone.popitem(last=False)
        self._retire(item.buffer)

    # -- GET --------------------------------------------------------------------------------
    def get(
        self, key: str, *, device: int | None = None, timeout: float | None = None, owner: str | None = None
    ) -> Lease:
        """The data of `key` on GPU `device`, waiting up to `timeout` seconds for its PUT."""
        self._check_open()
        gpu = self._default_device(device)
        timeout = self.config.get_timeout_s if timeout is None else timeout
        deadline = self.clock() + timeout
        while True:
            if self._view is not None and self._view.due(self.clock()):
                self.sync_global()
            with self._cond:
                self._check_open()
                item = self._items.get(key)
                if item is not None:
                    return self._get_local(item, gpu, owner)
                remote = self._view.lookup(key) if self._view is not None else None
                endpoint = self._view.endpoint(remote.node) if remote is not None else None
                if remote is None or endpoint is None:
                    now = self.clock()
                    if now >= deadline:
                        raise GetTimeout(key, timeout, self._why_missing(key, remote))
                    wake = deadline
                    if self._view is not None:
                        wake = min(wake, self._view.next_due())
                    self._cond.wait(max(0.0, wake - now))
                    continue
            handle = self._get_remote(key, remote, endpoint, gpu, owner, deadline - self.clock())
            if handle is not None:
                return handle
            with self._cond:  # the owner no longer had it: wait for the next refresh
                now = self.clock()
                if now >= deadline:
                    raise GetTimeout(key, timeout, f"node {remote.node} no longer holds it")
                self._cond.wait(max(0.0, min(deadline, self._view.next_due()) - now))  # type: ignore[union-attr]

    def _why_missing(self, key: str, remote: Location | None) -> str:
        if remote is not None:
            return f"the global table places it on node {remote.node}, whose endpoint is unknown"
        why = self._gone.get(key)
        if why is not None:
            return f"it was {why}"
        where = "this node's table" + (" and the global table" if self._view is not None else "")
        return f"never PUT as far as {where} knows"

    def _consume(self, item: _Item) -> None:
        if item.reads_left is not None:
            item.reads_left -= 1
            if item.reads_left == 0:
                self._remove(item, "consumed by its declared consumers")

    def _get_local(self, item: _Item, gpu: int, owner: str | None) -> Lease:
        """Serve a GET of a key of this node (called under the lock; releases it while copying)."""
        now = self.clock()
        src = item.buffer
        src.leases += 1  # pinned: the read below may retire it, and a copy reads it unlocked
        self._consume(item)
        if src.device == gpu:
            lease = self._new_lease(src, owner, item.ready, now)
            src.leases -= 1
            self.stats.gets[Transport.SAME_GPU.value] += 1
            return self._handle(item, src, lease, gpu, Transport.SAME_GPU)
        transport = Transport.HOST if src.device == HOST else Transport.PEER
        relocate = not item.moving and policy.relocate_on_read(
            self._item_state(item), gpu, self._gpu_states(self.capacities(now)),
            adaptive=self.config.adaptive_movement, reads_left=item.reads_left,
        )
        item.last_reader = gpu
        if relocate:
            self._account(gpu, item.nbytes)
        ready = item.ready
        self._cond.release()
        try:
            try:
                new = self._copy_to_reader(src, gpu, ready)
            except BaseException:
                with self._cond:
                    if relocate:
                        self._account(gpu, -item.nbytes)
                    src.leases -= 1
                    if src.leases == 0 and src.retired:
                        self._free(src)
                raise
        finally:
            self._cond.acquire()
        src.leases -= 1
        if relocate and self._items.get(item.key) is item and item.buffer is src and not item.moving:
            new.stored = True
            item.buffer, item.ready = new, None
            self.table.set(self._location(item))
            self._retire(src)
            self.stats.relocations += 1
        else:
            if relocate:
                self._account(gpu, -item.nbytes)
            new.retired = True  # the reader's private copy: freed when its handle is released
            if src.leases == 0 and src.retired:
                self._free(src)
        lease = self._new_lease(new, owner, None, self.clock())
        self.stats.gets[transport.value] += 1
        count_into(self.stats.copied_from, location_name(src.device), item.nbytes)
        self._cond.notify_all()
        return self._handle(item, new, lease, gpu, transport)

    def _get_remote(
        self, key: str, remote: Location, endpoint: str, gpu: int, owner: str | None, timeout: float
    ) -> Lease | None:
        from .rpc import fetch_remote  # pyzmq is needed only across nodes

        buf: _Buffer | None = None
        meta: dict[str, Any] = {}

        def sink(info: dict[str, Any]) -> Callable[[int, torch.Tensor], None]:
            nonlocal buf
            meta.update(info)
            n = int(info["nbytes"])
            address = self._alloc_gpu(gpu, n)
            buf = _Buffer(gpu, address, None, n, stored=False, retired=True)
            rt, stream = self._rt[gpu], self._copy_streams[gpu]

            def write(offset: int, chunk: torch.Tensor) -> None:
                rt.copy_htod_async(address + offset, chunk, chunk.numel(), stream)
                stream.synchronize()

            return write

        try:
            cfg = self.config
            transfer = fetch_remote(
                endpoint, key, sink, owner=owner or self.node, chunk_bytes=cfg.rpc_chunk_bytes,
                pipeline=cfg.rpc_pipeline, timeout_s=max(min(timeout, cfg.rpc_timeout_s), 0.1),
            )
        except BaseException:
            if buf is not None:
                with self._cond:
                    self._free(buf)
            raise
        if transfer is None:
            return None
        assert buf is not None
        dtype = parse_dtype(meta["dtype"])
        shape, strides = tuple(meta["shape"]), tuple(meta["strides"])
        item = _Item(key, dtype, shape, strides, buf.nbytes, buf, None, None, -1, None)
        with self._cond:
            lease = self._new_lease(buf, owner, None, self.clock())
            self.stats.gets[Transport.RPC.value] += 1
            self.stats.rpc_chunks += transfer.chunks
            self.stats.rpc_max_in_flight_bytes = max(self.stats.rpc_max_in_flight_bytes,
                                                     transfer.max_in_flight_bytes)
            return self._handle(item, buf, lease, gpu, Transport.RPC)

    # -- serving other nodes (called by rpc.RpcServer) ---------------------------------------
    def open_remote(self, key: str, owner: str) -> tuple[int, dict[str, Any]] | None:
        """Lease the bytes of `key` for a remote reader (counts as one read); None when absent."""
        with self._cond:
            item = self._items.get(key)
            if item is None:
                return None
            buf = item.buffer
            buf.leases += 1  # pinned across the read, which may retire it
            self._consume(item)
            lease = self._new_lease(buf, owner, item.ready, self.clock())
            buf.leases -= 1
            info = {"nbytes": item.nbytes, "dtype": dtype_name(item.dtype), "shape": list(item.shape),
                    "strides": list(item.strides)}
            return lease.id, info

    def read_remote(self, lease_id: int, offset: int, size: int, staging: dict[int, HostBuffer]) -> bytes:
        """`size` bytes at `offset` of a leased buffer, through a host staging buffer per GPU."""
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None:
                raise CommError(f"lease {lease_id} is not held (expired or closed)")
            buf, ready = lease.buffer, lease.ready
        if not 0 <= offset <= offset + size <= buf.nbytes:
            raise CommError(f"read of [{offset}, {offset + size}) outside {buf.nbytes} bytes")
        if buf.device == HOST:
            assert buf.host is not None
            return buf.host[offset : offset + size].numpy().tobytes()
        host = staging.get(buf.device)
        if host is None or host.nbytes < size:
            host = staging[buf.device] = self._rt[buf.device].host_alloc(max(size, 1), pinned=True)
        stream = self._copy_streams[buf.device]
        if ready is not None:
            stream.wait_event(ready)
        self._rt[buf.device].copy_dtoh_async(host, buf.address + offset, size, stream)
        stream.synchronize()
        return host.tensor()[:size].numpy().tobytes()

    def close_remote(self, lease_id: int) -> None:
        self._release_lease(lease_id, None)

    # -- DELETE and expiry ------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        """Remove `key` (bytes go once unleased): here, or on the node the global view places it on.
        False when neither holds it."""
        with self._cond:
            item = self._items.get(key)
            if item is not None:
                self._remove(item, "deleted")
                self._cond.notify_all()
                return True
            remote = self._view.lookup(key) if self._view is not None else None
            endpoint = self._view.endpoint(remote.node) if remote is not None else None  # type: ignore[union-attr]
        if endpoint is None:
            return False
        from .rpc import call

        _, body = call(endpoint, "delete", {"key": key}, self.config.rpc_timeout_s)
        return bool(body["deleted"])

    def expire(self, now: float | None = None) -> tuple[list[str], int]:
        """Drop keys past their TTL and leases past `lease_ttl_s`; returns (keys, leases)."""
        now = self.clock() if now is None else now
        with self._cond:
            if now < self._next_deadline:  # nothing can be due: the usual tick, O(1)
                return [], 0
            keys = policy.expired({k: it.expires_at for k, it in self._items.items()}, now)
            for key in keys:
                self._remove(self._items[key], "expired (TTL)")
            lease_ids = policy.expired({i: lease.deadline for i, lease in self._leases.items()}, now)
            for lease_id in lease_ids:
                lease = self._leases.pop(lease_id)
                log.warning("force-releasing an expired lease on %d bytes (owner %s)", lease.buffer.nbytes,
                            lease.owner)
                if lease.handle is not None and (h := lease.handle()) is not None:
                    h._expired()
                self._drop_lease(lease)
            self.stats.expired_keys += len(keys)
            self.stats.expired_leases += len(lease_ids)
            self._next_deadline = min(
                (d for d in (*(it.expires_at for it in self._items.values()),
                             *(lease.deadline for lease in self._leases.values())) if d is not None),
                default=math.inf,
            )
            return keys, len(lease_ids)

    # -- movement ---------------------------------------------------------------------------
    def plan(self, now: float | None = None, need: Mapping[int, int] | None = None) -> list[Move]:
        """What the policy would move now (nothing is moved)."""
        now = self.clock() if now is None else now
        with self._cond:
            gpus = self._gpu_states(self.capacities(now))
            if need is None and not policy.over_capacity(gpus):  # the ticker's usual round: O(GPUs)
                return []
            items = [self._item_state(it) for it in self._items.values()]
        return policy.plan_moves(gpus, items, adaptive=self.config.adaptive_movement, need=need)

    def rebalance(self, now: float | None = None) -> list[Move]:
        """Pressure awareness: move data off every GPU over its predicted capacity. Returns the moves
        done (each possibly redirected to host when its target turned out to be full)."""
        with self._move_lock:
            return self._execute(self.plan(now), reactive=False)

    def reclaim(self, gpu: int, nbytes: int) -> int:
        """Move at least `nbytes` of stored data off `gpu` now (the memory pool calls this when an
        allocation fails). Returns the bytes moved off (less when too little was movable)."""
        started = time.perf_counter()
        with self._move_lock:
            done = self._execute(self.plan(need={gpu: nbytes}), reactive=True)
        self._free_streams[gpu].synchronize()  # the bytes are back in the allocator on return
        with self._cond:
            self.stats.reclaims += 1
            self.stats.reclaim_seconds += time.perf_counter() - started
        return sum(m.nbytes for m in done if m.src == gpu)

    def _execute(self, moves: Iterable[Move], reactive: bool) -> list[Move]:
        done = []
        for move in moves:
            result = self._move(move, reactive)
            if result is not None:
                done.append(result)
        return done

    def _move(self, move: Move, reactive: bool) -> Move | None:
        started = time.perf_counter()
        with self._cond:
            item = self._items.get(move.key)
            if item is None or item.moving or item.buffer.device != move.src or item.buffer.leases:
                return None
            if move.dst == HOST and not quota.host_allows(self.config.quota, self._host_used, item.nbytes):
                return None  # the host tier is full: the data stays where it is
            item.moving = True
            src, ready = item.buffer, item.ready
            src.leases += 1
            self._account(move.dst, item.nbytes)
        dst, new = move.dst, None
        try:
            try:
                new = self._copy(src, dst, ready, stored=True)
            except OutOfDeviceMemory:
                if dst == HOST or not quota.host_allows(self.config.quota, self._host_used, item.nbytes):
                    raise
                with self._cond:
                    self._account(dst, -item.nbytes)
                    self._account(HOST, item.nbytes)
                dst = HOST
                new = self._copy(src, HOST, ready, stored=True)
        finally:
            with self._cond:
                item.moving = False
                src.leases -= 1
                current = self._items.get(move.key) is item and item.buffer is src
                if new is not None and current:
                    item.buffer, item.ready = new, None
                    self.table.set(self._location(item))
                    self._retire(src)
                else:
                    self._account(dst, -item.nbytes)
                    if new is not None:
                        new.stored = False
                        self._free(new)
                    if src.leases == 0 and src.retired:
                        self._free(src)
                self._cond.notify_all()
        if not current:
            return None
        with self._cond:
            rule = move.rule if dst == move.dst else policy.RULE_HOST
            stats = self.stats
            stats.moves[rule] = stats.moves.get(rule, 0) + 1
            path = f"{'reclaim' if reactive else 'pressure'}->{'host' if dst == HOST else 'gpu'}"
            stats.move_count[path] = stats.move_count.get(path, 0) + 1
            stats.move_bytes[path] = stats.move_bytes.get(path, 0) + item.nbytes
            stats.bytes_moved += item.nbytes
            count_into(stats.moved_to, location_name(dst), item.nbytes)
            self.stats.move_seconds += time.perf_counter() - started
        return Move(move.key, move.src, dst, move.nbytes, rule)

    # -- global table -----------------------------------------------------------------------
    def sync_global(self, now: float | None = None) -> None:
        """Publish this node's table and refresh the view of the others (when a global table is set)."""
        if self._global is None or self._view is None:
            return
        with self._sync_lock:
            with self._cond:
                entries = self.table.snapshot()
            self._global.publish(self.node, self.endpoint, entries)
            snapshot = self._global.snapshot()
            with self._cond:
                self._view.apply(snapshot, self.clock() if now is None else now)
                self._cond.notify_all()

    def synchronize(self) -> None:
        """Wait until every copy and free the store has issued has run (frees reach the allocator)."""
        for streams in (self._copy_streams, self._free_streams):
            for stream in streams.values():
                stream.synchronize()

    # -- the ticker -------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """One round of housekeeping: expiry, pressure-driven movement (PA), global sync when due."""
        now = self.clock() if now is None else now
        self.expire(now)
        if self.config.pressure_aware and self._items:  # nothing stored: nothing to move
            self.rebalance(now)
        if self._view is not None and self._view.due(now):
            self.sync_global(now)

    def start(self) -> CommStore:
        """Run `tick` every `config.tick_s` on a daemon thread until `close`."""
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick_loop, name=f"streambox-comm-{self.node}",
                                            daemon=True)
            self._ticker.start()
        return self

    def _tick_loop(self) -> None:
        """`tick` every `tick_s` while the store holds data or leases, every `idle_period_s` while it
        holds neither (nothing can expire or move; a PUT or a lease wakes it)."""
        config = self.config
        while not self._stop.is_set():
            with self._cond:  # as PUTs and leases read it, so that none is missed
                busy = bool(self._items or self._leases)
                self._ticker_idle = not busy
            self._wake.wait(config.tick_s if busy else config.idle_period_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.tick()
            except Exception:  # the ticker must survive one bad round; the error is logged
                log.exception("communication store tick failed")

    def close(self) -> None:
        """Stop the ticker and free every byte the store holds (outstanding handles become invalid)."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._cond:
            self._closed = True
            for item in list(self._items.values()):
                self._remove(item, "dropped when the store closed")
            for lease in list(self._leases.values()):
                if lease.handle is not None and (h := lease.handle()) is not None:
                    h._expired()
                self._drop_lease(lease)
            self._leases.clear()
            self._cond.notify_all()
        self._retire_streams()

    def _retire_streams(self) -> None:
        """Destroy the store's streams without leaving the allocators a reference to one: first every
        stream reaches its work (the frees issued on it included), then an allocator that tracks frees
        per stream (`retire_stream`, as `DeviceMemoryPool` does) gives them back and forgets it."""
        for gpu in self._rt:
            retire = getattr(self._alloc[gpu], "retire_stream", None)
            for stream in (self._copy_streams[gpu], self._free_streams[gpu]):
                stream.synchronize()
                if retire is not None:
                    retire(stream)
                stream.destroy()

    def __enter__(self) -> CommStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
