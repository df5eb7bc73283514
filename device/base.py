"""The GPU-runtime interface that everything above `device/` programs against.

One `Runtime` is one context on one device (a CUDA context, or its emulation). It offers exactly what
a serverless function may use: memory, a stream-ordered pool, pinned host buffers, asynchronous copies,
streams, events, kernel launch and *stream* synchronisation. Nothing device-wide (no
`cudaDeviceSynchronize`) is offered, because one function must never stall the others' streams.

Backends: `emulated.py` (default; functional or timed, modelled PCIe link and copy engines) and `cuda.py`
(cuda-python driver API). Nothing here imports a CUDA library.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

CopyKind = Literal["htod", "dtoh", "dtod", "peer"]

#: One kernel of `Runtime.launch_many`: (kernel, blocks, cu_cap, name, duration_s), `launch`'s arguments.
#: A plain tuple: a plan's issue loop builds one per kernel, where a named tuple costs ten times more.
KernelLaunch = tuple[Callable[[], object], int, "int | None", str, "float | None"]

#: Allocation granularity of device memory and of the pool: every address is a multiple of this.
ALIGNMENT = 256


class DeviceError(RuntimeError):
    """Base class of every error raised by the device layer."""


class OutOfDeviceMemory(DeviceError):
    """An allocation could not be met; the message names the requested and the free bytes."""

    def __init__(self, requested: int, free: int, total: int, where: str = "device") -> None:
        self.requested, self.free, self.total = requested, free, total
        super().__init__(
            f"out of {where} memory: requested {requested} bytes, {free} bytes free of {total}"
        )


class InvalidAddress(DeviceError):
    """A free of an unknown address (double free), or a use of freed memory."""


class KernelError(DeviceError):
    """A kernel failed. Raised at the next `synchronize` of its stream (or of an event recorded after
    it on that stream), once; the original exception is the `__cause__`. Later work on the stream
    still runs, and other streams are unaffected (unlike CUDA's sticky context errors: one function's
    failure must not take down the others sharing the runtime)."""

    def __init__(self, kernel: str, message: str) -> None:
        self.kernel = kernel
        super().__init__(message)


class BackendUnavailable(DeviceError):
    """The backend cannot run on this machine (for CUDA: no driver or no GPU)."""


@dataclass(frozen=True)
class DeviceProperties:
    """What `nvidia-smi` and `cuDeviceGetAttribute` would tell about one device."""

    index: int
    name: str
    total_memory: int
    compute_units: int
    backend: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceUsage:
    """A device's memory and stream usage summed over every runtime on the machine."""

    index: int
    name: str
    used_memory: int
    total_memory: int
    streams: int
    runtimes: int


@dataclass(frozen=True)
class TimelineRecord:
    """One operation as it ran: on which stream or engine, what, and when (seconds, monotonic)."""

    lane: str
    kind: str
    name: str
    start: float
    end: float
    nbytes: int = 0
    compute_units: int = 0


class Stream(abc.ABC):
    """An in-order queue of device work. Work on different streams may run concurrently."""

    priority: int

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the caller until all work issued to this stream so far has completed."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait until `event` completes (cuStreamWaitEvent)."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when all work issued so far has completed."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Release the stream once its work has completed."""


class Event(abc.ABC):
    """A marker in a stream. As in CUDA, an event never recorded counts as complete."""

    @abc.abstractmethod
    def record(self, stream: Stream) -> None:
        """Capture the current tail of `stream`; the event completes when that work does."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once the captured work has completed (non-blocking)."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the caller until the event completes."""

    @abc.abstractmethod
    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to `end`; both must have completed."""


class HostBuffer(abc.ABC):
    """Host memory for copies. Pinned buffers copy at full link speed; allocating them is costly."""

    nbytes: int
    pinned: bool

    @abc.abstractmethod
    def tensor(self) -> torch.Tensor:
        """A uint8 CPU tensor over the buffer's bytes (no copy)."""

    @abc.abstractmethod
    def free(self) -> None:
        """Release the buffer."""


class MemoryPool(abc.ABC):
    """A stream-ordered pool mirroring cuMemPool: reserved memory is kept until trimmed."""

    @abc.abstractmethod
    def alloc_async(self, nbytes: int, stream: Stream) -> int:
        """Allocate `nbytes` usable by work issued to `stream` from now on; returns an address."""

    @abc.abstractmethod
    def free_async(self, address: int, stream: Stream) -> None:
        """Return memory to the pool once work issued to `stream` so far has completed."""

    @abc.abstractmethod
    def trim_to(self, keep_bytes: int) -> None:
        """Release unused reserved memory back to the device, keeping at least `keep_bytes`."""

    @abc.abstractmethod
    def set_release_threshold(self, nbytes: int) -> None:
        """Reserved memory above this is released at stream synchronisation points."""

    @property
    @abc.abstractmethod
    def reserved_bytes(self) -> int:
        """Device memory the pool holds (used + cached)."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes handed out and not yet freed."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Free every reserved byte; live allocations become invalid."""


def contiguous_strides(shape: Iterable[int]) -> tuple[int, ...]:
    """Row-major strides, in elements, of `shape` (a zero-length dimension counts as one)."""
    strides, step = [], 1
    for d in reversed(list(shape)):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


_NOTHING_TO_SET = contextlib.nullcontext()


class Runtime(abc.ABC):
    """One context on one device. Thread-safe: the API proxy calls it from several threads."""

    index: int

    # -- properties -------------------------------------------------------------------------
    @abc.abstractmethod
    def properties(self) -> DeviceProperties: ...

    @abc.abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, counting every runtime on the machine."""

    @abc.abstractmethod
    def allocated_bytes(self) -> int:
        """Device bytes this runtime holds (context overhead, allocations and pools)."""

    # -- memory -----------------------------------------------------------------------------
    @abc.abstractmethod
    def mem_alloc(self, nbytes: int) -> int:
        """Synchronous device allocation, aligned to `ALIGNMENT`; returns an address."""

    @abc.abstractmethod
    def mem_free(self, address: int) -> None:
        """Free an address returned by `mem_alloc`; an unknown address raises `InvalidAddress`."""

    @abc.abstractmethod
    def create_pool(self, release_threshold: int = 0) -> MemoryPool: ...

    @abc.abstractmethod
    def host_alloc(self, nbytes: int, pinned: bool = True) -> HostBuffer: ...

    # -- streams and events -----------------------------------------------------------------
    @abc.abstractmethod
    def create_stream(self, priority: int = 0) -> Stream:
        """A new stream; lower numbers are higher priority, as in CUDA."""

    @abc.abstractmethod
    def create_event(self, timing: bool = True) -> Event: ...

    # -- copies (all asynchronous with respect to the host) ---------------------------------
    @abc.abstractmethod
    def copy_htod_async(
        self, dst: int, src: HostBuffer | torch.Tensor, nbytes: int, stream: Stream, src_offset: int = 0
    ) -> None:
        """Host to device. A CPU tensor counts as pageable memory (slower link, staged at issue)."""

    @abc.abstractmethod
    def copy_dtoh_async(
        self, dst: HostBuffer | torch.Tensor, src: int, nbytes: int, stream: Stream, dst_offset: int = 0
    ) -> None:
        """Device to host. The host destination must stay alive until the stream reaches the copy."""

    @abc.abstractmethod
    def copy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None: ...

    @abc.abstractmethod
    def copy_peer_async(
        self, dst: int, dst_runtime: Runtime, src: int, nbytes: int, stream: Stream
    ) -> None:
        """Copy from this runtime's device to another device's memory (NVLink/PCIe peer)."""

    # -- kernels ----------------------------------------------------------------------------
    @abc.abstractmethod
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
        """Run `kernel` on `stream` after the work issued before it.

        `kernel` computes over tensor views of device memory (see `view`). `blocks` is the kernel's
        grid size; it occupies min(blocks, cu_cap, compute_units) compute units while it runs.
        `duration_s`: the kernel's GPU time at full occupancy of `blocks` (modelled or measured). The
        emulated device in timed mode occupies the stream and units that long instead of running
        `kernel` (longer with fewer units); in functional mode and on CUDA it is ignored.
        """

    def launch_many(self, stream: Stream, launches: Sequence[KernelLaunch]) -> None:
        """`launch` each of `launches` on `stream`, in order: the same work as launching them one by
        one, which a backend may issue in one step (the emulated device: one operation of its stream,
        one placement transaction in timed mode; a CUDA graph is the GPU's analogue). Default: a loop."""
        for kernel, blocks, cu_cap, name, duration_s in launches:
            self.launch(stream, kernel, blocks=blocks, cu_cap=cu_cap, name=name, duration_s=duration_s)

    def issuing(self, stream: Stream) -> contextlib.AbstractContextManager[object]:
        """A block in which this thread launches many kernels on `stream` (a plan's run): a backend
        whose launch sets per-thread state (CUDA: torch's current device and stream) sets it once for
        the block. Launches on other streams inside it stay correct. Default: nothing to set."""
        return _NOTHING_TO_SET

    @abc.abstractmethod
    def view(
        self,
        address: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A typed tensor over device memory at `address` (no copy), for kernels to compute on."""

    # -- introspection ----------------------------------------------------------------------
    def timeline(self) -> list[TimelineRecord]:
        """What ran where and when, if the backend records it (the emulated one does)."""
        return []

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for every stream, free everything this runtime holds and leave the device."""

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """`nbytes` rounded up to a multiple of `alignment` (at least one unit)."""
    if nbytes < 0:
        raise ValueError(f"negative size: {nbytes}")
    return max(alignment, -(-nbytes // alignment) * alignment)


class Backend(abc.ABC):
    """The devices of one machine as seen through one backend."""

    name: str

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def device_usage(self) -> list[DeviceUsage]:
        """Per device: memory used by every runtime of every process on the machine, and streams."""

    @abc.abstractmethod
    def open_runtime(self, index: int = 0, *, gpu_percent: int | None = None) -> Runtime:
        """Create a context on device `index` (costly: time and device memory). `gpu_percent`: an
        MPS client limited to that share of the compute units (1-100); None: no MPS."""
