"""Host memory behind the functional emulator's device bytes, kept for reuse when released.

A functional emulated allocation is a host tensor. A fresh large tensor is a new mapping whose first
touch page-faults and zeroes every page in the kernel: about 0.1-0.2 ms of host CPU per MB, paid by
whoever writes it first (usually a weights copy on the copy engine's thread). A real GPU has no such
cost when its pool grows again after a trim (the driver maps physical pages it already holds), so a
pool that trims and grows often (resilient scaling) would be charged an emulator artifact: measured
under `bench_memory_pool.py --quick`'s workload, fm+rs grew and trimmed 4.3 GB in 24 s and its cold
weight loads waited 290-400 ms on average against static's 50-120 ms.

`SpareBacking` keeps released tensors by exact size, up to a byte budget, and hands them to the next
reservation of that size. Device memory accounting (the ledger) is unaffected: a spare is host memory
only. Contents are stale, as real freshly allocated device memory is.
"""

from __future__ import annotations

import threading

import torch

#: Host bytes kept for reuse per runtime (the emulated pools' chunks come in few sizes).
DEFAULT_SPARE_BYTES = 1 << 30


class SpareBacking:
    """Released host tensors by size, at most `limit_bytes` in all; thread-safe."""

    def __init__(self, limit_bytes: int = DEFAULT_SPARE_BYTES) -> None:
        if limit_bytes < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self.reused = 0
        self._by_size: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes`: a spare one if there is, else a fresh one."""
        with self._lock:
            spares = self._by_size.get(nbytes)
            if spares:
                self.bytes -= nbytes
                self.reused += 1
                return spares.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, data: torch.Tensor) -> None:
        """Keep `data` (released; nothing else may use it) if the budget allows, else drop it."""
        nbytes = data.numel()
        with self._lock:
            if self.bytes + nbytes <= self.limit_bytes:
                self._by_size.setdefault(nbytes, []).append(data)
                self.bytes += nbytes

    def clear(self) -> None:
        with self._lock:
            self._by_size.clear()
            self.bytes = 0
