"""The driver's staging of a copy from pageable host memory, as host work in timed mode.

A copy from pageable memory cannot be DMA'd directly: the CUDA driver copies the bytes chunk by chunk
into pinned staging buffers and DMAs each chunk while it stages the next, and `cuMemcpyHtoDAsync`
returns only once the last chunk is staged (CUDA Runtime API, "API synchronization behavior"). That
memcpy is CPU work on the issuing thread whatever the GPU. Timed mode moves no device bytes (phantom
data), but the host is real: without this, a pageable upload would cost the host nothing while a
loader that stages into its own pinned ring (the IO daemon) pays a real memcpy, and the emulator would
favour the pageable path. `PageableStager` does the driver's memcpy through one bounded scratch buffer
(the bytes are discarded: the destination is phantom) and says when the DMA may start and end so that
the modelled transfer overlaps the staging as the driver's pipeline does.
"""

from __future__ import annotations

import threading
import time

import torch

__all__ = ["STAGING_CHUNK_BYTES", "PageableStager", "transfer_floor"]

#: The driver's staging chunk. Modelled: the CUDA driver's pinned staging buffers are a few MiB (its
#: exact size is not documented); the chunk only bounds the scratch buffer and the last chunk's DMA.
STAGING_CHUNK_BYTES = 4 * 1024 * 1024


class PageableStager:
    """Stages pageable sources through one scratch buffer (per runtime; threads take turns)."""

    def __init__(self, chunk_bytes: int = STAGING_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._scratch: torch.Tensor | None = None
        self._lock = threading.Lock()
        self.staged_bytes = 0
        self.staging_seconds = 0.0

    def stage(self, source: torch.Tensor) -> tuple[float, int]:
        """Copy every byte of `source` (flat uint8) through the scratch buffer on this thread, as the
        driver does before the call returns; returns when the staging ended (`perf_counter`) and the
        size of the last chunk, whose DMA follows it (`transfer_floor`)."""
        nbytes = source.numel()
        started = time.perf_counter()
        if nbytes == 0:
            return started, 0
        chunk = self.chunk_bytes
        with self._lock:
            scratch = self._scratch
            if scratch is None:
                scratch = self._scratch = torch.empty(chunk, dtype=torch.uint8)
            for offset in range(0, nbytes, chunk):
                n = min(chunk, nbytes - offset)
                scratch[:n].copy_(source[offset : offset + n])
            staged = time.perf_counter()
            self.staged_bytes += nbytes
            self.staging_seconds += staged - started
        return staged, nbytes - (nbytes - 1) // chunk * chunk


def transfer_floor(issued: float, staged: float, cost: float, last_chunk_cost: float) -> float:
    """The modelled start of a pageable transfer of `cost` seconds issued at `issued`: it overlaps the
    staging (the driver DMAs chunk k while it stages k+1) but cannot end before the last chunk, staged
    at `staged`, has crossed the link (`last_chunk_cost`)."""
    return max(issued, staged + last_chunk_cost - cost)
