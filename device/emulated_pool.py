"""The stream-ordered memory pool of the emulated device (mirrors cuMemPool / cudaMallocAsync).

Each block is one device reservation (its own address range, counted in the ledger). `alloc_async`
hands out the best-fitting cached block (at most twice the request, any size under memory pressure),
else reserves a new block; when the device is full it first releases the pool's cached blocks and
retries. `free_async` marks the block pending at once (a second free raises) and returns it to the
cache when the stream reaches the free. `used_bytes` counts whole blocks handed out; `reserved_bytes`
counts every block the pool holds. Cached memory above the release threshold is given back at the
runtime's synchronisation points (stream or event synchronize), as CUDA does.

A free takes effect at the stream's modelled time: in timed mode that may still be in the future when
the stream resolves it, so the block waits in `_due` and joins the cache once the clock passes it
(settled lazily by every call that looks at the pool: no thread, no sleep).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import threading
import time
from typing import TYPE_CHECKING

from .address_space import Allocation, State
from .base import DeviceError, InvalidAddress, MemoryPool, OutOfDeviceMemory, Stream, aligned

if TYPE_CHECKING:
    from .emulated import EmulatedRuntime

#: A cached block is reused for a request only if it is at most this many times larger.
REUSE_SLACK = 2


class EmulatedPool(MemoryPool):
    def __init__(self, runtime: EmulatedRuntime, release_threshold: int = 0) -> None:
        if release_threshold < 0:
            raise ValueError(f"negative release threshold: {release_threshold}")
        self._runtime = runtime
        self.release_threshold = release_threshold
        self._lock = threading.RLock()
        self._blocks: dict[int, Allocation] = {}  # every reserved block, by address
        self._cached: list[tuple[int, int]] = []  # (size, address) of cached blocks, sorted
        self._reserved = 0
        self._used = 0
        self._due: list[tuple[float, int, Allocation]] = []  # (time, tie-break, block) freed later
        self._due_ids = itertools.count()
        self._destroyed = False

    def __repr__(self) -> str:
        return f"<EmulatedPool reserved={self._reserved} used={self._used}>"

    # -- allocation -------------------------------------------------------------------------
    def _cache(self, block: Allocation) -> None:
        if block.state is State.PENDING_FREE and self._blocks.get(block.start) is block:
            block.state = State.CACHED
            self._used -= block.size
            bisect.insort(self._cached, (block.size, block.start))

    def _settle(self) -> None:
        """Cache the blocks whose free the modelled clock has passed. Caller holds the lock."""
        if self._due:
            now = time.perf_counter()
            while self._due and self._due[0][0] <= now:
                self._cache(heapq.heappop(self._due)[2])

    def _take_cached(self, need: int, limit: int | None) -> Allocation | None:
        i = bisect.bisect_left(self._cached, (need, -1))
        if i == len(self._cached) or (limit is not None and self._cached[i][0] > limit):
            return None
        _, address = self._cached.pop(i)
        return self._blocks[address]

    def _add(self, block: Allocation) -> Allocation:
        self._blocks[block.start] = block
        self._reserved += block.size
        return block

    def _reserve_new(self, need: int) -> Allocation:
        try:
            return self._add(self._runtime.reserve(need, owner=self))
        except OutOfDeviceMemory:
            block = self._take_cached(need, None)  # under pressure any cached block fits
            if block is not None:
                return block
            if not self._cached:
                raise
            self._trim_locked(0)  # give the cache back to the device and try once more
            return self._add(self._runtime.reserve(need, owner=self))

    def alloc_async(self, nbytes: int, stream: Stream) -> int:
        self._runtime.own_stream(stream)
        need = aligned(nbytes)
        with self._lock:
            if self._destroyed:
                raise DeviceError("memory pool has been destroyed")
            self._settle()
            block = self._take_cached(need, REUSE_SLACK * need) or self._reserve_new(need)
            block.state = State.LIVE
            self._used += block.size
            return block.start

    def free_async(self, address: int, stream: Stream) -> None:
        s = self._runtime.own_stream(stream)
        with self._lock:
            block = self._blocks.get(address)
            if block is None or block.state is not State.LIVE:
                if block is not None:
                    raise InvalidAddress(
                        f"double free of pool address {address:#x} ({block.size} bytes, {block.state.value})"
                    )
                raise InvalidAddress(
                    f"free_async of device address {address:#x}: not a live allocation of this pool"
                )
            block.state = State.PENDING_FREE

        def reclaim(ready: float) -> float:
            with self._lock:
                if ready > time.perf_counter():
                    heapq.heappush(self._due, (ready, next(self._due_ids), block))
                else:
                    self._cache(block)
            return ready

        s.enqueue(reclaim, inline=True)

    # -- release ----------------------------------------------------------------------------
    def _release_block(self, block: Allocation) -> None:
        del self._blocks[block.start]
        self._reserved -= block.size
        if block.state in (State.LIVE, State.PENDING_FREE):
            self._used -= block.size
        self._runtime.release(block)

    def _trim_locked(self, keep: int) -> None:
        # Largest first while that keeps at least `keep`, then smallest first until at most `keep`.
        for size, address in sorted(self._cached, reverse=True):
            if self._reserved - size >= keep and self._reserved > keep:
                self._cached.remove((size, address))
                self._release_block(self._blocks[address])
        while self._reserved > keep and self._cached:
            _, address = self._cached.pop(0)
            self._release_block(self._blocks[address])

    def trim_to(self, keep_bytes: int) -> None:
        if keep_bytes < 0:
            raise ValueError(f"negative keep_bytes: {keep_bytes}")
        with self._lock:
            self._settle()
            self._trim_locked(keep_bytes)

    def set_release_threshold(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"negative release threshold: {nbytes}")
        self.release_threshold = nbytes

    def apply_release_threshold(self) -> None:
        with self._lock:
            self._settle()
            if self._reserved > self.release_threshold and self._cached:
                self._trim_locked(self.release_threshold)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def used_bytes(self) -> int:
        with self._lock:
            self._settle()
            return self._used

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            self._settle()
            return self._reserved - self._used

    def destroy(self) -> None:
        with self._lock:
            if self._destroyed:
                return
            self._destroyed = True
            for block in list(self._blocks.values()):
                self._release_block(block)
            self._cached.clear()
            self._due.clear()
        self._runtime.forget_pool(self)
