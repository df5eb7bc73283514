"""Host-side staging for the daemon: the shared pinned transfer ring (PB on) and host byte views.

The ring is ONE pinned host buffer, allocated once when the daemon starts (paying the pinned
allocation cost once), cut into `slots` slots of one block each. A block is staged into the next slot
(memcpy from the function's source tensor), copied to the device from there, and the slot is reused
only after that copy completed: the daemon retires the block's event before handing the slot out
again (`TransferRing.owner`). With PB off the daemon allocates a pinned buffer per request instead.

Staging copies go through numpy, which releases the GIL and uses one core: the daemon shares the host
with the functions' threads and the device's worker threads.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from streambox.device import HostBuffer, Runtime


def host_bytes(src: torch.Tensor | HostBuffer, what: str = "copy source") -> np.ndarray:
    """A flat uint8 numpy view (no copy) of a CPU tensor or a host buffer."""
    if isinstance(src, HostBuffer):
        return src.tensor().numpy()
    if isinstance(src, torch.Tensor):
        if src.device.type != "cpu":
            raise ValueError(f"{what}: the IO daemon copies host memory, got a tensor on {src.device}")
        if not src.is_contiguous():
            raise ValueError(f"{what}: host tensor must be contiguous")
        return src.detach().reshape(-1).view(torch.uint8).numpy()
    raise TypeError(f"{what}: expected a CPU tensor or a HostBuffer, got {type(src).__name__}")


class TransferRing:
    """`slots` pinned slots of `slot_bytes` each, handed out in turn."""

    def __init__(self, runtime: Runtime, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.buffer = runtime.host_alloc(slots * slot_bytes, pinned=True)
        self.bytes = host_bytes(self.buffer)
        self.bytes.fill(0)  # resident from the start, as pinned memory is (no page faults while staging)
        # What occupies each slot until its copy has completed (the daemon's in-flight record).
        self.owner: list[Any] = [None] * slots
        self._next = 0

    def next_slot(self) -> int:
        slot = self._next
        self._next = (slot + 1) % self.slots
        return slot

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def free(self) -> None:
        self.buffer.free()
