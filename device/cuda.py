"""The CUDA backend: the `base.py` interface over cuda-python's driver API (`cuda.bindings.driver`).

One `CudaRuntime` is the *primary context* of one device (`cuDevicePrimaryCtxRetain`), the context the
CUDA runtime API and therefore torch use too, so device pointers, streams and events are shared with
torch without any interop step. Every driver call runs with that context pushed on the calling thread
(`cuCtxPushCurrent`/`cuCtxPopCurrent`), so a runtime may be used from any thread, and two runtimes on
two devices may be used from the same thread.

Nothing here imports a CUDA library at import time: the driver module is loaded by
`CudaBackend.__init__` (see `_load_driver`), which raises `BackendUnavailable` when cuda-python is
missing, libcuda cannot be loaded or no GPU is present.

Every name this module takes from the driver module is listed in `DRIVER_ENTRY_POINTS`; a CPU-side test
checks that each exists in the installed cuda-python and that the list matches the uses in this file.

Kernels: `launch` runs a Python callable (torch operations over `view`s) with torch's current stream set
to ours (`torch.cuda.ExternalStream`); `launch_function` launches a `CUfunction` from `load_module` /
`get_function` with `cuLaunchKernel`. Only `launch_function` can honour `cu_cap` (persistent-thread-block
kernels receive the cap as an extra, last, int32 argument and run on min(grid, cap) blocks); for torch
operations `cu_cap` is advisory, as the number of SMs a torch kernel uses is not ours to choose.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .base import (
    ALIGNMENT,
    Backend,
    BackendUnavailable,
    DeviceError,
    DeviceProperties,
    DeviceUsage,
    Event,
    HostBuffer,
    InvalidAddress,
    MemoryPool,
    OutOfDeviceMemory,
    Runtime,
    Stream,
    aligned,
)
from .chunk_views import ChunkViews

__all__ = [
    "DRIVER_ENTRY_POINTS",
    "CudaBackend",
    "CudaError",
    "CudaEvent",
    "CudaHostBuffer",
    "CudaMemoryPool",
    "CudaModule",
    "CudaRuntime",
    "CudaStream",
]

#: Every attribute of `cuda.bindings.driver` this module uses: functions, types, and enum members as
#: "Enum.MEMBER". Kept in one place so that a test can check them against the installed cuda-python
#: and against the `driver.<name>` uses in this file's source.
DRIVER_ENTRY_POINTS: tuple[str, ...] = (
    # initialisation, devices, contexts
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceTotalMem",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuCtxPushCurrent",
    "cuCtxPopCurrent",
    "cuCtxGetStreamPriorityRange",
    "cuCtxEnablePeerAccess",
    "cuGetErrorName",
    "cuGetErrorString",
    # memory
    "cuMemGetInfo",
    "cuMemAlloc",
    "cuMemFree",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemPoolTrimTo",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    # copies
    "cuMemcpyHtoDAsync",
    "cuMemcpyDtoHAsync",
    "cuMemcpyDtoDAsync",
    "cuMemcpyPeerAsync",
    # streams and events
    "cuStreamCreateWithPriority",
    "cuStreamDestroy",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventDestroy",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventElapsedTime",
    # modules and kernels
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    # types
    "CUresult",
    "CUmemPoolProps",
    "cuuint64_t",
    "CU_MEMHOSTALLOC_PORTABLE",
    # enum members
    "CUresult.CUDA_SUCCESS",
    "CUresult.CUDA_ERROR_NOT_READY",
    "CUresult.CUDA_ERROR_OUT_OF_MEMORY",
    "CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR",
    "CUdevice_attribute.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID",
    "CUstream_flags.CU_STREAM_NON_BLOCKING",
    "CUevent_flags.CU_EVENT_DEFAULT",
    "CUevent_flags.CU_EVENT_DISABLE_TIMING",
    "CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD",
    "CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT",
    "CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT",
    "CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED",
    "CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE",
    "CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE",
)

#: The `cuda.bindings.driver` module once `_load_driver` has run; None before.
driver: Any = None

_INSTALL_HINT = "install it with `pip install 'streambox[cuda]'` (cuda-python 13.x)"
_FALLBACK_HINT = "use the emulated backend (device/emulated.py) on machines without an NVIDIA GPU"


class CudaError(DeviceError):
    """A driver call returned an error code; `code` is the CUresult value and `name` its name."""

    def __init__(self, what: str, code: int, name: str, description: str = "") -> None:
        self.what, self.code, self.name = what, code, name
        detail = f": {description}" if description else ""
        super().__init__(f"{what} failed with {name} ({code}){detail}")


# ------------------------------------------------------------------------------------------------
# driver loading and error checking


def _load_driver() -> Any:
    """Import `cuda.bindings.driver` (once); `BackendUnavailable` when cuda-python is missing."""
    global driver
    if driver is None:
        try:
            from cuda.bindings import driver as module
        except ImportError as exc:  # cuda-python not installed, or too old (no `cuda.bindings`)
            raise BackendUnavailable(
                f"CUDA backend unavailable: cuda-python is not installed ({exc}); {_INSTALL_HINT}, "
                f"or {_FALLBACK_HINT}"
            ) from exc
        driver = module
    return driver


def _error_name(code: Any) -> tuple[str, str]:
    """(name, description) of a CUresult; falls back to the enum name when libcuda cannot tell."""
    try:
        name = driver.CUresult(int(code)).name
    except (ValueError, TypeError):  # a code newer than these bindings: ask the driver
        name = f"CUresult {int(code)}"
        with contextlib.suppress(Exception):
            err, text = driver.cuGetErrorName(int(code))
            if err == driver.CUresult.CUDA_SUCCESS and text:
                name = text.decode() if isinstance(text, bytes) else str(text)
    description = ""
    with contextlib.suppress(Exception):  # libcuda unusable: the name is enough
        err, text = driver.cuGetErrorString(code)
        if err == driver.CUresult.CUDA_SUCCESS and text:
            description = text.decode() if isinstance(text, bytes) else str(text)
    return name, description


def _check(
    result: Any,
    what: str,
    *,
    requested: int | None = None,
    mem_info: Callable[[], tuple[int, int]] | None = None,
    where: str = "device",
) -> Any:
    """Unpack a driver call's `(CUresult, *values)`: the value(s), or raise on a non-success code.

    CUDA_ERROR_OUT_OF_MEMORY becomes `OutOfDeviceMemory(requested, free, total)` when `requested` is
    given; `mem_info` supplies (free, total) for the message (cuMemGetInfo for device memory).
    """
    if not isinstance(result, tuple):
        result = (result,)
    code = result[0]
    if code != driver.CUresult.CUDA_SUCCESS:
        if code == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY and requested is not None:
            free, total = 0, 0
            if mem_info is not None:
                with contextlib.suppress(Exception):  # the report must not hide the OOM
                    free, total = mem_info()
            raise OutOfDeviceMemory(requested, free, total, where)
        name, description = _error_name(code)
        raise CudaError(what, int(code), name, description)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def _host_memory_info() -> tuple[int, int]:
    """(available, total) bytes of host memory, for pinned-allocation failures."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class _Current:
    """`with runtime._current():` pushes the runtime's context on this thread and pops it after."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        _check(driver.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")

    def __exit__(self, *exc: object) -> None:
        driver.cuCtxPopCurrent()


# ------------------------------------------------------------------------------------------------
# pure helpers (no driver calls): array interface, kernel arguments, grids

#: torch dtypes that NumPy's typestr (parsed by torch for __cuda_array_interface__) can name.
_TYPESTR: dict[torch.dtype, str] = {
    torch.bool: "|b1",
    torch.uint8: "|u1",
    torch.int8: "|i1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.complex64: "<c8",
    torch.complex128: "<c16",
}
#: Carrier typestr by item size for the other dtypes (bfloat16, float8, uint16...): reinterpreted after.
_CARRIER: dict[int, tuple[str, torch.dtype]] = {
    1: ("|u1", torch.uint8),
    2: ("<i2", torch.int16),
    4: ("<i4", torch.int32),
    8: ("<i8", torch.int64),
}


class CudaArray:
    """An object exposing `__cuda_array_interface__` (v3) over raw device memory.

    `strides` are in elements, as in torch; the interface carries them in bytes. For dtypes NumPy cannot
    name, the interface describes a same-sized integer type and `carrier` tells `view` to reinterpret.
    """

    def __init__(
        self,
        address: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        strides: Sequence[int] | None = None,
    ) -> None:
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        if strides is not None:
            strides = tuple(int(s) for s in strides)
            if len(strides) != len(shape) or any(s < 0 for s in strides):
                raise ValueError(f"strides {strides} do not fit shape {shape}")
        size = dtype.itemsize
        if int(address) % size:
            raise InvalidAddress(f"view at device address {int(address):#x} is misaligned for {dtype}")
        if dtype in _TYPESTR:
            typestr, self.carrier = _TYPESTR[dtype], None
        elif size in _CARRIER:
            typestr, self.carrier = _CARRIER[size]
        else:
            raise TypeError(f"cannot view device memory as {dtype}")
        self.address, self.dtype, self.shape, self.strides = int(address), dtype, shape, strides
        self.__cuda_array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": typestr,
            "data": (int(address), False),
            "strides": None if strides is None else tuple(s * size for s in strides),
            # No stream: ordering against our streams is the caller's business (kernels run in them).
            "stream": None,
        }


class _KernelArgs:
    """Kernel arguments packed as the `void**` array cuLaunchKernel takes; keeps them alive.

    Each argument is a ctypes instance (used as is: `c_int32(n)`, `c_float(x)`, a Structure), a
    `(value, ctype)` pair, a Python int (a device pointer: 64-bit), a float (`c_float`), a bool
    (`c_bool`) or a cuda-python handle such as `CUdeviceptr` (64-bit). Integers that are not
    pointers must be given with their ctype, since a kernel's parameter sizes are not visible here.
    """

    def __init__(self, args: Sequence[Any]) -> None:
        self.values: list[Any] = [self._ctype(a) for a in args]
        self.array = (ctypes.c_void_p * max(1, len(self.values)))(
            *[ctypes.addressof(v) for v in self.values]
        )

    @staticmethod
    def _ctype(arg: Any) -> Any:
        if isinstance(arg, ctypes._SimpleCData | ctypes.Structure | ctypes.Union | ctypes.Array):
            return arg
        if isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[1], type):
            return arg[1](arg[0])
        if isinstance(arg, bool):
            return ctypes.c_bool(arg)
        if isinstance(arg, int):
            return ctypes.c_uint64(arg)
        if isinstance(arg, float):
            return ctypes.c_float(arg)
        if callable(getattr(arg, "getPtr", None)):  # CUdeviceptr and other driver handles
            return ctypes.c_uint64(int(arg))
        raise TypeError(f"unsupported kernel argument {arg!r} of type {type(arg).__name__}")

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array) if self.values else 0


def _dim3(dims: int | Sequence[int], what: str) -> tuple[int, int, int]:
    if isinstance(dims, int):
        dims = (dims,)
    dims = tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive sizes, got {dims}")
    return (dims + (1, 1))[:3]  # type: ignore[return-value]


def _physical_grid(
    grid: int | Sequence[int], cu_cap: int | None
) -> tuple[tuple[int, int, int], int | None]:
    """The grid to launch and the cap to pass: a capped (persistent) kernel runs min(grid, cap) blocks."""
    gx, gy, gz = _dim3(grid, "grid")
    if cu_cap is None:
        return (gx, gy, gz), None
    cu_cap = int(cu_cap)
    if cu_cap < 1:
        raise ValueError(f"cu_cap must be at least 1, got {cu_cap}")
    if gy != 1 or gz != 1:
        raise ValueError(f"a capped (persistent) kernel needs a 1-D grid, got {(gx, gy, gz)}")
    return (min(gx, cu_cap), 1, 1), cu_cap


# ------------------------------------------------------------------------------------------------
# streams, events, host buffers, pools, modules


class CudaStream(Stream):
    """A non-blocking driver stream (it never synchronises with the legacy default stream)."""

    def __init__(self, runtime: CudaRuntime, handle: Any, priority: int) -> None:
        self.runtime, self.handle, self.priority = runtime, handle, priority
        self.destroyed = False
        self._torch_stream: torch.cuda.ExternalStream | None = None

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def torch_stream(self) -> torch.cuda.ExternalStream:
        """This stream as a torch stream object, for `with torch.cuda.stream(...)`."""
        if self._torch_stream is None:
            self._torch_stream = torch.cuda.ExternalStream(
                self.ptr, device=torch.device("cuda", self.runtime.index)
            )
        return self._torch_stream

    def _live(self) -> Any:
        if self.destroyed:
            raise DeviceError("use of a destroyed stream")
        return self.handle

    def synchronize(self) -> None:
        with self.runtime._current():
            _check(driver.cuStreamSynchronize(self._live()), "cuStreamSynchronize")

    def wait_event(self, event: Event) -> None:
        handle = _event_handle(event)
        with self.runtime._current():
            _check(driver.cuStreamWaitEvent(self._live(), handle, 0), "cuStreamWaitEvent")

    def query(self) -> bool:
        with self.runtime._current():
            (code,) = driver.cuStreamQuery(self._live())
        if code == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check((code,), "cuStreamQuery")
        return True

    def destroy(self) -> None:
        """cuStreamDestroy returns at once; the driver releases the stream when its work is done."""
        if self.destroyed:
            return
        with self.runtime._current():
            _check(driver.cuStreamDestroy(self.handle), "cuStreamDestroy")
        self.destroyed = True
        self.runtime._forget(self.runtime._streams, self)

    def __repr__(self) -> str:
        return f"CudaStream(device={self.runtime.index}, ptr={self.ptr:#x}, priority={self.priority})"


def _stream_handle(stream: Stream, runtime: CudaRuntime | None = None) -> Any:
    if not isinstance(stream, CudaStream):
        raise TypeError(f"expected a CudaStream, got {type(stream).__name__}")
    if runtime is not None and stream.runtime.index != runtime.index:
        # Runtimes of one device share its primary context, so their streams are interchangeable.
        raise DeviceError(f"{stream!r} is on device {stream.runtime.index}, not {runtime.index}")
    return stream._live()


def _event_handle(event: Event) -> Any:
    if not isinstance(event, CudaEvent):
        raise TypeError(f"expected a CudaEvent, got {type(event).__name__}")
    if event.handle is None:
        raise DeviceError("use of a destroyed event")
    return event.handle


def _destroy_event(runtime_ref: weakref.ref[CudaRuntime], handle: Any) -> None:
    runtime = runtime_ref()
    if runtime is None or runtime.closed:
        return
    try:
        with runtime._current():
            driver.cuEventDestroy(handle)
    except Exception:  # finalizers must not raise
        pass


class CudaEvent(Event):
    """A driver event; destroyed by `destroy()`, by garbage collection or by the runtime's `close()`."""

    def __init__(self, runtime: CudaRuntime, handle: Any, timing: bool) -> None:
        self.runtime, self.handle, self.timing = runtime, handle, timing
        self._finalizer = weakref.finalize(self, _destroy_event, weakref.ref(runtime), handle)
        self._finalizer.atexit = False

    def record(self, stream: Stream) -> None:
        stream_handle = _stream_handle(stream)
        with self.runtime._current():
            _check(driver.cuEventRecord(_event_handle(self), stream_handle), "cuEventRecord")

    def query(self) -> bool:
        with self.runtime._current():
            (code,) = driver.cuEventQuery(_event_handle(self))
        if code == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _check((code,), "cuEventQuery")
        return True

    def synchronize(self) -> None:
        with self.runtime._current():
            _check(driver.cuEventSynchronize(_event_handle(self)), "cuEventSynchronize")

    def elapsed_ms(self, end: Event) -> float:
        with self.runtime._current():
            ms = _check(
                driver.cuEventElapsedTime(_event_handle(self), _event_handle(end)), "cuEventElapsedTime"
            )
        return float(ms)

    def destroy(self) -> None:
        """Release the event (not in `base.Event`; garbage collection does it too)."""
        self._finalizer()
        self.handle = None


class CudaHostBuffer(HostBuffer):
    """Host memory: page-locked from cuMemHostAlloc (portable to every context) or a pageable tensor.

    The tensor from `tensor()` aliases the buffer: it must not be used after `free()`.
    """

    def __init__(self, runtime: CudaRuntime, nbytes: int, pinned: bool) -> None:
        self.runtime, self.nbytes, self.pinned = runtime, nbytes, pinned
        self._tensor: torch.Tensor | None = None
        self.freed = False
        if pinned:
            with runtime._current():
                self.address = int(
                    _check(
                        driver.cuMemHostAlloc(max(1, nbytes), driver.CU_MEMHOSTALLOC_PORTABLE),
                        "cuMemHostAlloc",
                        requested=nbytes,
                        mem_info=_host_memory_info,
                        where="pinned host",
                    )
                )
        else:
            self._tensor = torch.empty(nbytes, dtype=torch.uint8)
            self.address = self._tensor.data_ptr()

    def tensor(self) -> torch.Tensor:
        if self.freed:
            raise InvalidAddress(f"use of a freed host buffer at {self.address:#x}")
        if self._tensor is None:
            if self.nbytes == 0:
                self._tensor = torch.empty(0, dtype=torch.uint8)
            else:
                raw = (ctypes.c_uint8 * self.nbytes).from_address(self.address)
                self._tensor = torch.frombuffer(raw, dtype=torch.uint8)
        return self._tensor

    def free(self) -> None:
        """Release the buffer; a second call does nothing (as in the emulated backend)."""
        if self.freed:
            return
        self.freed = True
        self._tensor = None
        if self.pinned:
            with self.runtime._current():
                _check(driver.cuMemFreeHost(self.address), "cuMemFreeHost")
        self.runtime._forget(self.runtime._host_buffers, self)


class CudaMemoryPool(MemoryPool):
    """A cuMemPool on the runtime's device; reserved and used bytes are the driver's own counters."""

    def __init__(self, runtime: CudaRuntime, release_threshold: int) -> None:
        self.runtime = runtime
        self._lock = threading.Lock()
        self._live: dict[int, int] = {}  # address -> bytes, to catch double and foreign frees
        props = driver.CUmemPoolProps()
        props.allocType = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.handleTypes = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        props.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = runtime.index
        with runtime._current():
            self.handle = _check(driver.cuMemPoolCreate(props), "cuMemPoolCreate")
        self.destroyed = False
        self.set_release_threshold(release_threshold)

    def _pool(self) -> Any:
        if self.destroyed:
            raise DeviceError("use of a destroyed memory pool")
        return self.handle

    def alloc_async(self, nbytes: int, stream: Stream) -> int:
        size = aligned(nbytes)
        stream_handle = _stream_handle(stream, self.runtime)
        with self.runtime._current():
            ptr = _check(
                driver.cuMemAllocFromPoolAsync(size, self._pool(), stream_handle),
                "cuMemAllocFromPoolAsync",
                requested=size,
                mem_info=self.runtime._memory_info_current,
            )
        address = int(ptr)
        if address % ALIGNMENT:
            raise DeviceError(f"cuMemAllocFromPoolAsync returned {address:#x}, not {ALIGNMENT}-aligned")
        with self._lock:
            self._live[address] = size
        self.runtime._views.add(address, size)
        return address

    def free_async(self, address: int, stream: Stream) -> None:
        stream_handle = _stream_handle(stream, self.runtime)
        with self._lock:
            if address not in self._live:
                raise InvalidAddress(f"free of {address:#x}, which this pool did not hand out (or freed)")
            del self._live[address]
        self.runtime._views.remove(address)
        with self.runtime._current():
            _check(driver.cuMemFreeAsync(address, stream_handle), "cuMemFreeAsync")

    def trim_to(self, keep_bytes: int) -> None:
        with self.runtime._current():
            _check(driver.cuMemPoolTrimTo(self._pool(), int(keep_bytes)), "cuMemPoolTrimTo")

    def set_release_threshold(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"negative release threshold: {nbytes}")
        with self.runtime._current():
            _check(
                driver.cuMemPoolSetAttribute(
                    self._pool(),
                    driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    driver.cuuint64_t(int(nbytes)),
                ),
                "cuMemPoolSetAttribute(RELEASE_THRESHOLD)",
            )

    def _attribute(self, attr: Any, what: str) -> int:
        if self.destroyed:
            return 0
        with self.runtime._current():
            return int(_check(driver.cuMemPoolGetAttribute(self.handle, attr), what))

    @property
    def reserved_bytes(self) -> int:
        return self._attribute(
            driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
            "cuMemPoolGetAttribute(RESERVED_MEM_CURRENT)",
        )

    @property
    def used_bytes(self) -> int:
        return self._attribute(
            driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            "cuMemPoolGetAttribute(USED_MEM_CURRENT)",
        )

    @property
    def live_allocations(self) -> dict[int, int]:
        """Address -> bytes of what was handed out and not yet given to `free_async`."""
        with self._lock:
            return dict(self._live)

    def destroy(self) -> None:
        """Free the live allocations (on the runtime's internal stream), then destroy the pool.

        Frees already issued on other streams that have not run yet delay the release of their
        memory until they run (cuMemPoolDestroy's own semantics); nothing device-wide is synchronised.
        """
        if self.destroyed:
            return
        with self._lock:
            live, self._live = list(self._live), {}
        for address in live:
            self.runtime._views.remove(address)
        with self.runtime._current():
            if live:
                internal = self.runtime._internal_stream()
                for address in live:
                    _check(driver.cuMemFreeAsync(address, internal), "cuMemFreeAsync")
                _check(driver.cuStreamSynchronize(internal), "cuStreamSynchronize")
            _check(driver.cuMemPoolTrimTo(self.handle, 0), "cuMemPoolTrimTo")
            _check(driver.cuMemPoolDestroy(self.handle), "cuMemPoolDestroy")
        self.destroyed = True
        self.runtime._forget(self.runtime._pools, self)


class CudaModule:
    """A loaded module (cubin, fatbin or PTX); its functions are valid until `unload()`."""

    def __init__(self, runtime: CudaRuntime, handle: Any) -> None:
        self.runtime, self.handle = runtime, handle
        self.unloaded = False

    def unload(self) -> None:
        if self.unloaded:
            return
        with self.runtime._current():
            _check(driver.cuModuleUnload(self.handle), "cuModuleUnload")
        self.unloaded = True
        self.runtime._forget(self.runtime._modules, self)


ModuleImage = str | os.PathLike[str] | bytes | bytearray | memoryview


def _module_image(path_or_bytes: ModuleImage) -> bytes:
    if isinstance(path_or_bytes, bytes | bytearray | memoryview):
        image = bytes(path_or_bytes)
    else:
        with open(path_or_bytes, "rb") as f:
            image = f.read()
    is_elf = image.startswith(b"\x7fELF")
    is_fatbin = image.startswith(b"\x50\xed\x55\xba")
    if not (is_elf or is_fatbin) and not image.endswith(b"\0"):
        image += b"\0"  # PTX text must be NUL-terminated
    return image


# ------------------------------------------------------------------------------------------------
# the runtime


MPS_PERCENT_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"

#: Runs one teardown step and records its error instead of raising it (CudaRuntime.close).
_Attempt = Callable[[Callable[[], object]], None]


def _require_mps_share(gpu_percent: int, *, first_context: bool) -> None:
    if not (isinstance(gpu_percent, int) and 1 <= gpu_percent <= 100):
        raise ValueError(f"gpu_percent must be an integer from 1 to 100, got {gpu_percent!r}")
    current = os.environ.get(MPS_PERCENT_ENV)
    if current == str(gpu_percent):
        return
    if first_context and current is None:
        os.environ[MPS_PERCENT_ENV] = str(gpu_percent)  # read by the driver at context creation
        return
    raise DeviceError(
        f"gpu_percent={gpu_percent}: MPS shares are per process and fixed at its first context "
        f"(${MPS_PERCENT_ENV}={current!r} here); start a process with "
        f"{MPS_PERCENT_ENV}={gpu_percent} and the MPS control daemon running"
    )


class CudaRuntime(Runtime):
    """The primary context of one device. Thread-safe; see the module docstring."""

    def __init__(self, backend: CudaBackend, index: int) -> None:
        self.backend, self.index = backend, index
        self.closed = False
        self._lock = threading.RLock()
        self.device = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        self.context = _check(driver.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self._scope = _Current(self.context)
        self._allocations: dict[int, int] = {}  # mem_alloc address -> bytes
        self._allocated = 0
        self._views = ChunkViews(self._base_view)  # fast views into this runtime's allocations
        self._issuing = threading.local()  # .stream: the stream `issuing` made current on this thread
        self._pools: list[CudaMemoryPool] = []
        self._streams: list[CudaStream] = []
        self._host_buffers: list[CudaHostBuffer] = []
        self._modules: list[CudaModule] = []
        self._events: weakref.WeakSet[CudaEvent] = weakref.WeakSet()
        self._internal: Any = None
        self._peers_enabled: set[int] = set()
        try:
            with self._current():
                self._properties = self._query_properties()
                least, greatest = _check(driver.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
                self.priority_range = (int(greatest), int(least))  # (highest, lowest), e.g. (-5, 0)
        except BaseException:
            driver.cuDevicePrimaryCtxRelease(self.device)
            raise

    # -- helpers ----------------------------------------------------------------------------
    def _current(self) -> _Current:
        if self.closed:
            raise DeviceError(f"use of a closed runtime (device {self.index})")
        return self._scope

    def _query_properties(self) -> DeviceProperties:
        dev = self.device
        raw_name = _check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
        name = raw_name.split(b"\0", 1)[0].decode() if isinstance(raw_name, bytes) else str(raw_name)
        total = int(_check(driver.cuDeviceTotalMem(dev), "cuDeviceTotalMem"))

        def attribute(which: Any) -> int:
            return int(_check(driver.cuDeviceGetAttribute(which, dev), f"cuDeviceGetAttribute({which.name})"))

        sms = attribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        major = attribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = attribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        bus = attribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)
        return DeviceProperties(
            index=self.index,
            name=name,
            total_memory=total,
            compute_units=sms,
            backend="cuda",
            extra={"compute_capability": (major, minor), "pci_bus_id": bus},
        )

    def _memory_info_current(self) -> tuple[int, int]:
        """cuMemGetInfo with the context already current (used inside `_check` for OOM reports)."""
        free, total = _check(driver.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def _internal_stream(self) -> Any:
        """A private non-blocking stream for the runtime's own housekeeping (pool teardown)."""
        with self._lock:
            if self._internal is None:
                self._internal = _check(
                    driver.cuStreamCreateWithPriority(driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                    "cuStreamCreateWithPriority",
                )
            return self._internal

    def _forget(self, registry: list[Any], item: object) -> None:
        """Drop a destroyed stream, pool, host buffer or module from this runtime's books."""
        with self._lock:
            if item in registry:
                registry.remove(item)

    @property
    def stream_count(self) -> int:
        with self._lock:
            return len(self._streams)

    # -- properties -------------------------------------------------------------------------
    def properties(self) -> DeviceProperties:
        return self._properties

    def memory_info(self) -> tuple[int, int]:
        with self._current():
            return self._memory_info_current()

    def allocated_bytes(self) -> int:
        """`mem_alloc` bytes (as aligned) plus every live pool's reserved bytes.

        The primary context's own footprint is not counted: it is shared with torch and with every
        other runtime of this process on the device, so no one runtime holds it.
        """
        with self._lock:
            pools = list(self._pools)
            total = self._allocated
        return total + sum(pool.reserved_bytes for pool in pools)

    # -- memory -----------------------------------------------------------------------------
    def mem_alloc(self, nbytes: int) -> int:
        size = aligned(nbytes)
        with self._current():
            ptr = _check(
                driver.cuMemAlloc(size), "cuMemAlloc", requested=size, mem_info=self._memory_info_current
            )
        address = int(ptr)
        with self._lock:
            self._allocations[address] = size
            self._allocated += size
        self._views.add(address, size)
        return address

    def mem_free(self, address: int) -> None:
        with self._lock:
            size = self._allocations.pop(address, None)
            if size is None:
                raise InvalidAddress(f"free of {address:#x}, which mem_alloc did not return (or was freed)")
            self._allocated -= size
        self._views.remove(address)
        with self._current():
            _check(driver.cuMemFree(address), "cuMemFree")

    def create_pool(self, release_threshold: int = 0) -> CudaMemoryPool:
        pool = CudaMemoryPool(self, release_threshold)
        with self._lock:
            self._pools.append(pool)
        return pool

    def host_alloc(self, nbytes: int, pinned: bool = True) -> CudaHostBuffer:
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        buffer = CudaHostBuffer(self, int(nbytes), pinned)
        with self._lock:
            self._host_buffers.append(buffer)
        return buffer

    # -- streams and events -----------------------------------------------------------------
    def create_stream(self, priority: int = 0) -> CudaStream:
        highest, lowest = self.priority_range
        effective = min(max(int(priority), highest), lowest)
        with self._current():
            handle = _check(
                driver.cuStreamCreateWithPriority(driver.CUstream_flags.CU_STREAM_NON_BLOCKING, effective),
                "cuStreamCreateWithPriority",
            )
        stream = CudaStream(self, handle, effective)
        with self._lock:
            self._streams.append(stream)
        return stream

    def create_event(self, timing: bool = True) -> CudaEvent:
        flags = (
            driver.CUevent_flags.CU_EVENT_DEFAULT if timing else driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
        )
        with self._current():
            handle = _check(driver.cuEventCreate(flags), "cuEventCreate")
        event = CudaEvent(self, handle, timing)
        self._events.add(event)
        return event

    # -- copies -----------------------------------------------------------------------------
    @staticmethod
    def _host_pointer(host: HostBuffer | torch.Tensor, offset: int, nbytes: int, what: str) -> int:
        if isinstance(host, CudaHostBuffer):
            if host.freed:
                raise InvalidAddress(f"{what}: use of a freed host buffer at {host.address:#x}")
            base, limit = host.address, host.nbytes
        else:
            tensor = host.tensor() if isinstance(host, HostBuffer) else host
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{what}: expected a HostBuffer or a CPU tensor, got {type(host).__name__}")
            if tensor.device.type != "cpu":
                raise ValueError(f"{what}: the host side must be a CPU tensor, got one on {tensor.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"{what}: the host tensor must be contiguous")
            base, limit = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if nbytes < 0 or offset < 0 or offset + nbytes > limit:
            raise ValueError(f"{what}: bytes [{offset}, {offset + nbytes}) exceed the host side's {limit}")
        return base + offset

    def copy_htod_async(
        self, dst: int, src: HostBuffer | torch.Tensor, nbytes: int, stream: Stream, src_offset: int = 0
    ) -> None:
        """A pageable source (CPU tensor, unpinned buffer) is staged by the driver before this returns."""
        host = self._host_pointer(src, src_offset, nbytes, "copy_htod_async")
        stream_handle = _stream_handle(stream, self)
        if nbytes == 0:
            return
        with self._current():
            _check(driver.cuMemcpyHtoDAsync(dst, host, nbytes, stream_handle), "cuMemcpyHtoDAsync")

    def copy_dtoh_async(
        self, dst: HostBuffer | torch.Tensor, src: int, nbytes: int, stream: Stream, dst_offset: int = 0
    ) -> None:
        """With a pageable destination the driver returns only once the copy is done."""
        host = self._host_pointer(dst, dst_offset, nbytes, "copy_dtoh_async")
        stream_handle = _stream_handle(stream, self)
        if nbytes == 0:
            return
        with self._current():
            _check(driver.cuMemcpyDtoHAsync(host, src, nbytes, stream_handle), "cuMemcpyDtoHAsync")

    def copy_dtod_async(self, dst: int, src: int, nbytes: int, stream: Stream) -> None:
        stream_handle = _stream_handle(stream, self)
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        if nbytes == 0:
            return
        with self._current():
            _check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, stream_handle), "cuMemcpyDtoDAsync")

    def _enable_peer_access(self, peer: CudaRuntime) -> None:
        """Direct (NVLink/PCIe P2P) access to `peer`'s memory when the devices allow it; once."""
        if peer.index == self.index or peer.index in self._peers_enabled:
            return
        with self._lock:
            self._peers_enabled.add(peer.index)
        can = _check(driver.cuDeviceCanAccessPeer(self.device, peer.device), "cuDeviceCanAccessPeer")
        if not can:
            return  # cuMemcpyPeerAsync stages through the host instead
        (code,) = driver.cuCtxEnablePeerAccess(peer.context, 0)
        if code != driver.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
            _check((code,), "cuCtxEnablePeerAccess")

    def copy_peer_async(
        self, dst: int, dst_runtime: Runtime, src: int, nbytes: int, stream: Stream
    ) -> None:
        if not isinstance(dst_runtime, CudaRuntime):
            raise TypeError(f"peer copy to a {type(dst_runtime).__name__}; both ends must be CUDA runtimes")
        if dst_runtime.closed:
            raise DeviceError(f"peer copy to a closed runtime (device {dst_runtime.index})")
        stream_handle = _stream_handle(stream, self)
        if nbytes < 0:
            raise ValueError(f"negative size: {nbytes}")
        if nbytes == 0:
            return
        with self._current():
            self._enable_peer_access(dst_runtime)
            _check(
                driver.cuMemcpyPeerAsync(dst, dst_runtime.context, src, self.context, nbytes, stream_handle),
                "cuMemcpyPeerAsync",
            )

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
        """Run `kernel` with torch's current device and stream set to ours, so its ops enqueue there.

        Tensors the callable allocates come from torch's caching allocator (not this runtime's
        accounting). `cu_cap` is advisory here; see `launch_function` for kernels that honour it.
        `duration_s` is ignored: a real GPU takes the time it takes.
        """
        if blocks < 1:
            raise ValueError(f"blocks must be at least 1, got {blocks}")
        if cu_cap is not None and cu_cap < 1:
            raise ValueError(f"cu_cap must be at least 1, got {cu_cap}")
        if getattr(self._issuing, "stream", None) is stream:  # inside `issuing(stream)`: already current
            kernel()
            return
        _stream_handle(stream, self)  # a live stream of this device, or raise
        assert isinstance(stream, CudaStream)
        with torch.cuda.device(self.index), torch.cuda.stream(stream.torch_stream()):
            kernel()

    @contextlib.contextmanager
    def issuing(self, stream: Stream) -> Iterator[None]:
        """Torch's current device and stream set to ours once for the kernels launched on `stream` from
        this thread until the block ends (a plan's run), instead of per launch (two context managers:
        several microseconds of each kernel's host time)."""
        _stream_handle(stream, self)
        assert isinstance(stream, CudaStream)
        previous = getattr(self._issuing, "stream", None)
        with torch.cuda.device(self.index), torch.cuda.stream(stream.torch_stream()):
            self._issuing.stream = stream
            try:
                yield
            finally:
                self._issuing.stream = previous

    def launch_function(
        self,
        stream: Stream,
        function: Any,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        args: Sequence[Any] = (),
        shared_mem: int = 0,
        cu_cap: int | None = None,
    ) -> None:
        """cuLaunchKernel of a `CUfunction` (see `get_function`) on `stream`.

        `args` as in `_KernelArgs` (ctypes instances, `(value, ctype)` pairs, device pointers as ints).
        With `cu_cap`, the kernel is a persistent-thread-block one: it gets the cap as an extra, last,
        int32 argument, and the physical grid is min(grid, cu_cap) blocks (the grid must be 1-D).
        """
        (gx, gy, gz), cap = _physical_grid(grid, cu_cap)
        bx, by, bz = _dim3(block, "block")
        params = list(args)
        if cap is not None:
            params.append(ctypes.c_int32(cap))
        packed = _KernelArgs(params)
        stream_handle = _stream_handle(stream, self)
        with self._current():
            _check(
                driver.cuLaunchKernel(
                    function, gx, gy, gz, bx, by, bz, int(shared_mem), stream_handle, packed.address, 0
                ),
                "cuLaunchKernel",
            )

    def load_module(self, path_or_bytes: ModuleImage) -> CudaModule:
        """Load a cubin, fatbin or PTX (a path or its bytes) into this context (cuModuleLoadData)."""
        image = _module_image(path_or_bytes)
        with self._current():
            handle = _check(driver.cuModuleLoadData(image), "cuModuleLoadData")
        module = CudaModule(self, handle)
        with self._lock:
            self._modules.append(module)
        return module

    def get_function(self, module: CudaModule | Any, name: str | bytes) -> Any:
        """The `CUfunction` called `name` (its mangled name for C++ kernels) in `module`."""
        handle = module.handle if isinstance(module, CudaModule) else module
        if isinstance(module, CudaModule) and module.unloaded:
            raise DeviceError("get_function on an unloaded module")
        raw = name.encode() if isinstance(name, str) else bytes(name)
        with self._current():
            return _check(driver.cuModuleGetFunction(handle, raw), f"cuModuleGetFunction({name!r})")

    def view(
        self,
        address: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        strides: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """A torch CUDA tensor over `address`; `strides` in elements. Inside an allocation of this runtime
        it is a slice of that allocation's tensor (`ChunkViews`), elsewhere (memory opened from another
        process) a tensor made through `__cuda_array_interface__`."""
        fast = self._views.view(int(address), dtype, tuple(int(d) for d in shape), strides)
        if fast is not None:
            return fast
        return self._interface_view(address, dtype, shape, strides)

    def _base_view(self, start: int, nbytes: int) -> torch.Tensor:
        return self._interface_view(start, torch.uint8, (nbytes,))

    def _interface_view(
        self, address: int, dtype: torch.dtype, shape: Sequence[int], strides: Sequence[int] | None = None
    ) -> torch.Tensor:
        array = CudaArray(address, dtype, shape, strides)
        device = torch.device("cuda", self.index)
        with torch.cuda.device(self.index):
            tensor = torch.as_tensor(array, device=device)
        if array.carrier is not None:
            tensor = tensor.view(dtype)
        return tensor

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        errors: list[BaseException] = []

        def attempt(fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as exc:  # keep tearing down; report the first error after
                errors.append(exc)

        self._release_all(attempt)
        self._views.clear()
        self.closed = True
        attempt(lambda: _check(driver.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease"))
        self.backend._forget_runtime(self)
        if errors:
            raise errors[0]

    def _release_all(self, attempt: _Attempt) -> None:
        """Wait for every stream, then free what this context made, users before what they use (events,
        pools, allocations, host buffers, modules, streams, the internal stream), each step through
        `attempt` so that one failure does not stop the rest."""
        with self._lock:
            streams, pools = list(self._streams), list(self._pools)
            buffers, modules = list(self._host_buffers), list(self._modules)
            events = list(self._events)
        for stream in streams:
            attempt(stream.synchronize)
        for event in events:
            attempt(event.destroy)
        for pool in pools:
            attempt(pool.destroy)
        with self._lock:
            allocations = list(self._allocations)
        for address in allocations:
            attempt(lambda address=address: self.mem_free(address))
        for buffer in buffers:
            if not buffer.freed:
                attempt(buffer.free)
        for module in modules:
            attempt(module.unload)
        for stream in streams:
            attempt(stream.destroy)
        self._destroy_internal_stream(attempt)

    def _destroy_internal_stream(self, attempt: _Attempt) -> None:
        if self._internal is None:
            return

        def destroy_internal() -> None:
            with self._current():
                _check(driver.cuStreamDestroy(self._internal), "cuStreamDestroy")

        attempt(destroy_internal)
        self._internal = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"CudaRuntime(device={self.index}, {self._properties.name!r}, {state})"


# ------------------------------------------------------------------------------------------------
# the backend


class CudaBackend(Backend):
    """The NVIDIA GPUs of this machine through the CUDA driver API."""

    name = "cuda"

    def __init__(self) -> None:
        _load_driver()
        try:
            code = driver.cuInit(0)
        except (RuntimeError, OSError) as exc:  # cuda.pathfinder: libcuda.so not found
            raise BackendUnavailable(
                f"CUDA backend unavailable: the NVIDIA driver library (libcuda) could not be loaded "
                f"({type(exc).__name__}: {exc}). Install the NVIDIA driver on a machine with a GPU, "
                f"or {_FALLBACK_HINT}"
            ) from exc
        code = code[0] if isinstance(code, tuple) else code
        if code != driver.CUresult.CUDA_SUCCESS:
            name, description = _error_name(code)
            raise BackendUnavailable(
                f"CUDA backend unavailable: cuInit failed with {name}"
                f"{': ' + description if description else ''}. Check that a GPU is visible "
                f"(nvidia-smi, CUDA_VISIBLE_DEVICES) and the driver is loaded, or {_FALLBACK_HINT}"
            )
        self._count = int(_check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))
        if self._count == 0:
            raise BackendUnavailable(f"CUDA backend unavailable: no CUDA device is visible; {_FALLBACK_HINT}")
        self._lock = threading.Lock()
        self._runtimes: list[CudaRuntime] = []

    def device_count(self) -> int:
        return self._count

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self._count:
            raise DeviceError(f"no CUDA device {index}: {self._count} visible")

    def open_runtime(self, index: int = 0, *, gpu_percent: int | None = None) -> CudaRuntime:
        """`gpu_percent` needs MPS, which CUDA offers per *process*: the MPS control daemon must run
        and `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` must be set before the process creates its first
        context. It is set here when this process has no context yet; otherwise it must already
        equal `gpu_percent`, else this raises (a share cannot change for a live process)."""
        self._check_index(index)
        if gpu_percent is not None:
            first = not self.runtimes() and not torch.cuda.is_initialized()
            _require_mps_share(gpu_percent, first_context=first)
        runtime = CudaRuntime(self, index)
        with self._lock:
            self._runtimes.append(runtime)
        return runtime

    def _forget_runtime(self, runtime: CudaRuntime) -> None:
        with self._lock:
            if runtime in self._runtimes:
                self._runtimes.remove(runtime)

    def runtimes(self) -> list[CudaRuntime]:
        with self._lock:
            return list(self._runtimes)

    def _probe(self, index: int) -> tuple[str, int, int]:
        """(name, free, total) of a device no runtime of ours holds, through its primary context.

        Retaining the primary context is free when it is already active (torch, another process's
        view is per process); otherwise this creates it for the query and releases it after.
        """
        device = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        raw = _check(driver.cuDeviceGetName(256, device), "cuDeviceGetName")
        name = raw.split(b"\0", 1)[0].decode() if isinstance(raw, bytes) else str(raw)
        context = _check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        try:
            with _Current(context):
                free, total = _check(driver.cuMemGetInfo(), "cuMemGetInfo")
        finally:
            driver.cuDevicePrimaryCtxRelease(device)
        return name, int(free), int(total)

    def device_usage(self) -> list[DeviceUsage]:
        """cuMemGetInfo per device (every process's use); streams and runtimes are this process's."""
        usage = []
        runtimes = self.runtimes()
        for index in range(self._count):
            mine = [r for r in runtimes if r.index == index and not r.closed]
            if mine:
                free, total = mine[0].memory_info()
                name = mine[0].properties().name
            else:
                name, free, total = self._probe(index)
            usage.append(
                DeviceUsage(
                    index=index,
                    name=name,
                    used_memory=total - free,
                    total_memory=total,
                    streams=sum(r.stream_count for r in mine),
                    runtimes=len(mine),
                )
            )
        return usage
