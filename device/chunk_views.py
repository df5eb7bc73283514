"""Tensor views into device allocations through one base tensor per allocation.

A view made through ``__cuda_array_interface__`` costs an interface import per tensor (tens of
microseconds of host time on the first GPU machine this ran on); the plan executor makes views each
time a kernel's buffers move to other addresses. As in the emulated backend, where a view is a
slice of its allocation's host tensor, `ChunkViews` keeps one uint8 tensor per live allocation (made
by the backend the first time the allocation is viewed) and serves a view as a bisect over the
allocation starts and an ``as_strided`` of that tensor, typed per dtype once.

Only addresses inside a registered allocation, with the whole view inside it, are served; anything
else (memory opened from another process, torch's own) is the backend's slow path (`view` returns
None). The backend registers an allocation when it hands it out and forgets it when it frees it.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable

import torch

from .base import InvalidAddress, contiguous_strides


class ChunkViews:
    """Views into registered allocations. Thread-safe."""

    def __init__(self, make_base: Callable[[int, int], torch.Tensor]) -> None:
        self._make_base = make_base  # (start, nbytes) -> a uint8 tensor over exactly those bytes
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted
        self._sizes: dict[int, int] = {}  # start -> bytes
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # (start, dtype) -> base as dtype

    def __len__(self) -> int:
        return len(self._starts)

    def add(self, start: int, nbytes: int) -> None:
        with self._lock:
            if start not in self._sizes:
                bisect.insort(self._starts, start)
            self._sizes[start] = nbytes
            self._drop_typed(start)

    def remove(self, start: int) -> None:
        """Forget an allocation (its memory is being freed); unknown starts are ignored."""
        with self._lock:
            if self._sizes.pop(start, None) is not None:
                del self._starts[bisect.bisect_left(self._starts, start)]
                self._drop_typed(start)

    def clear(self) -> None:
        with self._lock:
            self._starts.clear()
            self._sizes.clear()
            self._typed.clear()

    def view(
        self,
        address: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None = None,
    ) -> torch.Tensor | None:
        """A view of `shape` at `address`, or None where the view is not inside one registered allocation."""
        itemsize = dtype.itemsize
        if strides is None:
            strides = contiguous_strides(shape)
        pairs = zip(shape, strides, strict=True)
        span = 0 if math.prod(shape) == 0 else 1 + sum((d - 1) * s for d, s in pairs)
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            start = self._starts[i]
            size = self._sizes[start]
            offset = address - start
            if offset + span * itemsize > size:
                return None
            if offset % itemsize:
                raise InvalidAddress(f"view at device address {address:#x} is misaligned for {dtype}")
            typed = self._typed.get((start, dtype))
            if typed is None:
                usable = size - size % itemsize
                typed = self._typed[(start, dtype)] = self._make_base(start, size)[:usable].view(dtype)
        return typed.as_strided(shape, strides, offset // itemsize)

    def _drop_typed(self, start: int) -> None:
        for key in [k for k in self._typed if k[0] == start]:
            del self._typed[key]
