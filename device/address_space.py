"""Synthetic device addresses of the emulated backend and the table that maps them to host memory.

Addresses are plain ints, unique in the process across every emulated device and runtime (as with
CUDA's unified addressing), aligned to `ALIGNMENT`, and never reused: a bump pointer hands them out
with a guard gap of one alignment unit, so an address just past an allocation is never inside the
next. Each allocation is backed by its own uint8 CPU tensor. Addresses inside an allocation (carved
out by a memory pool above the device layer) resolve by bisecting the sorted allocation starts.
"""

from __future__ import annotations

import bisect
import enum
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import ALIGNMENT, InvalidAddress

#: Where the synthetic address space starts (looks like a device pointer, far from zero).
BASE_ADDRESS = 0x7F00_0000_0000


class AddressSpace:
    """A process-wide bump allocator of address ranges; ranges are never handed out twice."""

    def __init__(self, base: int = BASE_ADDRESS, alignment: int = ALIGNMENT) -> None:
        self._next = base
        self._alignment = alignment
        self._lock = threading.Lock()

    def reserve(self, nbytes: int) -> int:
        span = -(-max(nbytes, 1) // self._alignment) * self._alignment
        with self._lock:
            start = self._next
            self._next += span + self._alignment  # guard gap
            return start


#: The one address space of this process.
ADDRESS_SPACE = AddressSpace()


class State(enum.Enum):
    LIVE = "live"  # usable
    PENDING_FREE = "pending free"  # free_async issued, the stream has not reached it: still usable
    CACHED = "cached in pool"  # freed into its pool: not usable until handed out again
    FREED = "freed"


@dataclass(eq=False)
class Allocation:
    start: int
    size: int
    data: torch.Tensor | None
    owner: Any = None  # None: mem_alloc; otherwise the pool that reserved it
    state: State = State.LIVE
    # The bytes reinterpreted per dtype, made once: a view is then a single as_strided call.
    typed: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def typed_data(self, dtype: torch.dtype) -> torch.Tensor:
        flat = self.typed.get(dtype)
        if flat is None:
            assert self.data is not None
            flat = self.typed[dtype] = self.data.view(dtype)
        return flat

    @property
    def end(self) -> int:
        return self.start + self.size

    @property
    def usable(self) -> bool:
        return self.state in (State.LIVE, State.PENDING_FREE)


class AllocationTable:
    """The allocations of one runtime, by address. Thread-safe."""

    def __init__(self, remember_freed: int = 65536) -> None:
        self._starts: list[int] = []
        self._by_start: dict[int, Allocation] = {}
        self._freed: OrderedDict[int, int] = OrderedDict()  # start -> size, for diagnostics
        self._remember = remember_freed
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._starts)

    def insert(self, alloc: Allocation) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, alloc.start)
            self._starts.insert(i, alloc.start)
            self._by_start[alloc.start] = alloc

    def remove(self, start: int) -> Allocation:
        """Forget the allocation starting at `start`; it becomes FREED and its memory is dropped."""
        with self._lock:
            alloc = self._by_start.pop(start, None)
            if alloc is None:
                raise InvalidAddress(self._describe(start, "free"))
            del self._starts[bisect.bisect_left(self._starts, start)]
            alloc.state = State.FREED
            alloc.data = None
            alloc.typed.clear()
            self._freed[start] = alloc.size
            if len(self._freed) > self._remember:
                self._freed.popitem(last=False)
            return alloc

    def get(self, start: int) -> Allocation | None:
        with self._lock:
            return self._by_start.get(start)

    def containing(self, address: int) -> Allocation | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            alloc = self._by_start[self._starts[i]]
            return alloc if address < alloc.end else None

    def resolve(self, address: int, nbytes: int, what: str = "access") -> tuple[Allocation, int]:
        """The usable allocation holding [address, address + nbytes) and the offset into it."""
        alloc = self.containing(address)
        if alloc is None:
            raise InvalidAddress(self._describe(address, what))
        if not alloc.usable:
            raise InvalidAddress(
                f"use after free: {what} at device address {address:#x} in allocation "
                f"{alloc.start:#x} ({alloc.size} bytes), which is {alloc.state.value}"
            )
        if address + nbytes > alloc.end:
            raise InvalidAddress(
                f"{what} of {nbytes} bytes at device address {address:#x} runs past the end of "
                f"allocation {alloc.start:#x} ({alloc.size} bytes) by {address + nbytes - alloc.end} bytes"
            )
        return alloc, address - alloc.start

    def all(self) -> list[Allocation]:
        with self._lock:
            return [self._by_start[s] for s in self._starts]

    def _describe(self, address: int, what: str) -> str:
        with self._lock:
            freed = list(self._freed.items())
        for start, size in reversed(freed):
            if start <= address < start + size:
                if what == "free" and address == start:
                    return f"double free of device address {address:#x} ({size} bytes, already freed)"
                return (
                    f"use after free: {what} at device address {address:#x}, inside freed allocation "
                    f"{start:#x} ({size} bytes)"
                )
        if what == "free":
            return f"invalid free: device address {address:#x} is not the start of a live allocation"
        return f"invalid device address {address:#x} for {what}: not inside any live allocation"
