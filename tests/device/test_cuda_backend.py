"""The CUDA backend (`device/cuda.py`).

CPU-side tests run everywhere cuda-python is installed: the driver names the backend uses exist, the
backend reports a missing GPU as `BackendUnavailable`, and its pure helpers (error mapping, array
interface, kernel arguments, grids) behave. Tests marked `gpu` need a real NVIDIA GPU and skip cleanly
elsewhere (`requires_gpu`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from streambox.device import cuda as cuda_backend
from streambox.device.base import (
    ALIGNMENT,
    BackendUnavailable,
    DeviceError,
    InvalidAddress,
    OutOfDeviceMemory,
    aligned,
)


def _have_cuda_python() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings.driver") is not None
    except (ImportError, ValueError):  # no `cuda` package, or one without `bindings`
        return False


HAVE_CUDA_PYTHON = _have_cuda_python()
needs_cuda_python = pytest.mark.skipif(
    not HAVE_CUDA_PYTHON, reason="cuda-python is not installed (pip install 'streambox[cuda]')"
)
gpu = pytest.mark.gpu

MiB = 1 << 20


@functools.cache
def _probe() -> tuple[cuda_backend.CudaBackend | None, str]:
    try:
        return cuda_backend.CudaBackend(), ""
    except BackendUnavailable as exc:
        return None, str(exc)


def requires_gpu() -> cuda_backend.CudaBackend:
    """The CUDA backend, or skip the calling test when it is unavailable (no cuda-python, driver, GPU)."""
    backend, why = _probe()
    if backend is None:
        pytest.skip(f"no usable GPU: {why}")
    return backend


def _driver_sources() -> list[Path]:
    here = Path(cuda_backend.__file__).parent
    return sorted(here.glob("cuda*.py"))


# ------------------------------------------------------------------------------------------------
# CPU-side


@needs_cuda_python
def test_every_driver_entry_point_exists() -> None:
    from cuda.bindings import driver

    missing = []
    for name in cuda_backend.DRIVER_ENTRY_POINTS:
        obj = driver
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(name)
                break
    assert not missing, f"not in cuda.bindings.driver {driver.__name__}: {missing}"


def test_entry_point_list_matches_source() -> None:
    """Every `driver.<name>` (or `driver.<Enum>.<MEMBER>`) in device/cuda*.py is listed, and vice versa."""
    pattern = re.compile(r"(?<![\w.])driver\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
    used: set[str] = set()
    for path in _driver_sources():
        used |= set(pattern.findall(path.read_text()))
    listed = set(cuda_backend.DRIVER_ENTRY_POINTS)
    # `driver.CUresult.CUDA_SUCCESS` uses `CUresult` too, but only the full name needs listing.
    unlisted = sorted(used - listed)
    unused = sorted(
        name for name in listed if name not in used and not any(u.startswith(name + ".") for u in used)
    )
    assert not unlisted, f"driver names used but missing from DRIVER_ENTRY_POINTS: {unlisted}"
    assert not unused, f"DRIVER_ENTRY_POINTS lists names the backend does not use: {unused}"
    assert len(listed) == len(cuda_backend.DRIVER_ENTRY_POINTS), "duplicates in DRIVER_ENTRY_POINTS"


def test_import_does_not_load_cuda(tmp_path: Path) -> None:
    """Importing the backend loads no CUDA module of its own (torch may import cuda.bindings itself)."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import streambox.device.cuda as backend\n"
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'cuda'))\n"
        "print(backend.driver is None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def test_no_gpu_raises_backend_unavailable() -> None:
    backend, _ = _probe()
    if backend is not None:
        pytest.skip("a GPU is present")
    with pytest.raises(BackendUnavailable) as info:
        cuda_backend.CudaBackend()
    message = str(info.value)
    assert message.startswith("CUDA backend unavailable")
    # Actionable: says what is missing and what to do instead.
    assert "emulated backend" in message
    if HAVE_CUDA_PYTHON:
        assert "driver" in message or "GPU" in message
    else:
        assert "pip install" in message


def test_classes_implement_the_whole_interface() -> None:
    for cls in (
        cuda_backend.CudaBackend,
        cuda_backend.CudaRuntime,
        cuda_backend.CudaStream,
        cuda_backend.CudaEvent,
        cuda_backend.CudaMemoryPool,
        cuda_backend.CudaHostBuffer,
    ):
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {set(cls.__abstractmethods__)} abstract"


@needs_cuda_python
def test_check_maps_error_codes() -> None:
    driver = cuda_backend._load_driver()
    assert cuda_backend._check((driver.CUresult.CUDA_SUCCESS,), "x") is None
    assert cuda_backend._check((driver.CUresult.CUDA_SUCCESS, 5), "x") == 5
    assert cuda_backend._check((driver.CUresult.CUDA_SUCCESS, 1, 2), "x") == (1, 2)
    with pytest.raises(cuda_backend.CudaError) as info:
        cuda_backend._check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemcpyHtoDAsync")
    assert isinstance(info.value, DeviceError)
    assert "CUDA_ERROR_INVALID_VALUE" in str(info.value) and "cuMemcpyHtoDAsync" in str(info.value)
    assert info.value.code == int(driver.CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(OutOfDeviceMemory) as oom:
        cuda_backend._check(
            (driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None),
            "cuMemAlloc",
            requested=4096,
            mem_info=lambda: (1024, 8192),
        )
    assert (oom.value.requested, oom.value.free, oom.value.total) == (4096, 1024, 8192)
    # Without a size the OOM is a plain driver error.
    with pytest.raises(cuda_backend.CudaError, match="CUDA_ERROR_OUT_OF_MEMORY"):
        cuda_backend._check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY,), "cuModuleLoadData")


def test_cuda_array_interface() -> None:
    arr = cuda_backend.CudaArray(0x7F0000001000, torch.float32, (4, 8), (1, 4))
    cai = arr.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (0x7F0000001000, False)
    assert cai["shape"] == (4, 8) and cai["typestr"] == "<f4"
    assert cai["strides"] == (4, 16)  # bytes
    assert arr.carrier is None
    contiguous = cuda_backend.CudaArray(256, torch.int64, (3,)).__cuda_array_interface__
    assert contiguous["strides"] is None
    bf16 = cuda_backend.CudaArray(256, torch.bfloat16, (2, 2), (2, 1))
    assert bf16.__cuda_array_interface__["typestr"] == "<i2" and bf16.carrier == torch.int16
    assert bf16.__cuda_array_interface__["strides"] == (4, 2)
    with pytest.raises(ValueError):
        cuda_backend.CudaArray(256, torch.float32, (2, 2), (1,))
    with pytest.raises(ValueError):
        cuda_backend.CudaArray(256, torch.float32, (2, 2), (-1, 2))
    with pytest.raises(InvalidAddress):
        cuda_backend.CudaArray(258, torch.float32, (2,))


def test_kernel_arguments_and_grids() -> None:
    args = cuda_backend._KernelArgs(
        [0x1234_5678_9ABC, ctypes.c_int32(-3), (7, ctypes.c_uint16), 1.5, True]
    )
    assert len(args.values) == 5
    pointers = [args.array[i] for i in range(5)]
    assert ctypes.c_uint64.from_address(pointers[0]).value == 0x1234_5678_9ABC
    assert ctypes.c_int32.from_address(pointers[1]).value == -3
    assert ctypes.c_uint16.from_address(pointers[2]).value == 7
    assert ctypes.c_float.from_address(pointers[3]).value == 1.5
    assert ctypes.c_bool.from_address(pointers[4]).value is True
    assert cuda_backend._KernelArgs([]).address == 0
    with pytest.raises(TypeError):
        cuda_backend._KernelArgs(["nope"])

    assert cuda_backend._physical_grid(100, None) == ((100, 1, 1), None)
    assert cuda_backend._physical_grid((4, 5), None) == ((4, 5, 1), None)
    assert cuda_backend._physical_grid(100, 8) == ((8, 1, 1), 8)
    assert cuda_backend._physical_grid(3, 8) == ((3, 1, 1), 8)
    with pytest.raises(ValueError):
        cuda_backend._physical_grid((4, 5), 8)
    with pytest.raises(ValueError):
        cuda_backend._physical_grid(4, 0)
    with pytest.raises(ValueError):
        cuda_backend._dim3((1, 2, 3, 4), "block")


def test_module_image(tmp_path: Path) -> None:
    assert cuda_backend._module_image(b".version 7.0") == b".version 7.0\0"
    assert cuda_backend._module_image(b".version 7.0\0") == b".version 7.0\0"
    elf = b"\x7fELF" + bytes(12)
    assert cuda_backend._module_image(elf) == elf
    path = tmp_path / "k.ptx"
    path.write_bytes(b"// ptx")
    assert cuda_backend._module_image(path) == b"// ptx\0"


# ------------------------------------------------------------------------------------------------
# CPU-side, through a fake driver: every call site is first made against the real cuda-python
# function, which converts and checks its arguments before it fails to find libcuda, so a wrong
# argument type or count fails here; the fake then answers with host memory standing in for device
# memory (copies are memmoves, streams and events complete at once).


class FakeDriver:
    """Stands in for `cuda.bindings.driver` on machines without libcuda; see the section comment."""

    def __init__(self, real: object, devices: int = 2, total: int = 1 << 30) -> None:
        self._real = real
        self.devices, self.total = devices, total
        self.ok = real.CUresult.CUDA_SUCCESS
        self.calls: list[str] = []
        self.ctx_stack: list[int] = []
        self.ctx_refs = [0] * devices
        self.memory: dict[int, tuple[object, int, str]] = {}  # address -> (buffer, size, kind)
        self.pools: dict[int, dict[str, int]] = {}
        self.handles = 100
        self.live: dict[str, set[int]] = {"stream": set(), "event": set(), "module": set()}
        self.kernel_param_types: list[type] = []
        self.launches: list[tuple[tuple[int, ...], list[object]]] = []

    def __getattr__(self, name: str) -> object:
        if name.startswith("cu") and not name.startswith("cuuint"):
            raise AttributeError(f"FakeDriver does not implement {name}")
        return getattr(self._real, name)  # enums, types, constants

    def _validate(self, name: str, *args: object) -> None:
        """The real call must get past argument conversion: it fails only for want of libcuda."""
        self.calls.append(name)
        try:
            getattr(self._real, name)(*args)
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise AssertionError(f"{name}{args!r}: bad arguments: {exc!r}") from exc
        except RuntimeError:
            pass

    def _handle(self, kind: str) -> int:
        self.handles += 1
        self.live.setdefault(kind, set()).add(self.handles)
        return self.handles

    def _alloc(self, size: int, kind: str) -> int:
        used = sum(n for _, n, k in self.memory.values() if k != "host")
        if kind != "host" and used + size > self.total:
            raise MemoryError
        buf = ctypes.create_string_buffer(size + ALIGNMENT)
        address = -(-ctypes.addressof(buf) // ALIGNMENT) * ALIGNMENT
        self.memory[address] = (buf, size, kind)
        return address

    def _current(self) -> None:
        assert self.ctx_stack, "driver call without a current context"

    # -- init, devices, contexts
    def cuInit(self, flags):
        self._validate("cuInit", flags)
        return (self.ok,)

    def cuDeviceGetCount(self):
        self._validate("cuDeviceGetCount")
        return (self.ok, self.devices)

    def cuDeviceGet(self, ordinal):
        self._validate("cuDeviceGet", ordinal)
        return (self.ok, self._real.CUdevice(ordinal))

    def cuDeviceGetName(self, length, dev):
        self._validate("cuDeviceGetName", length, dev)
        return (self.ok, b"Fake GPU " + str(int(dev)).encode() + b"\0\0\0")

    def cuDeviceTotalMem(self, dev):
        self._validate("cuDeviceTotalMem", dev)
        return (self.ok, self.total)

    def cuDeviceGetAttribute(self, attrib, dev):
        self._validate("cuDeviceGetAttribute", attrib, dev)
        values = {"MULTIPROCESSOR_COUNT": 132, "COMPUTE_CAPABILITY_MAJOR": 9}
        return (self.ok, values.get(attrib.name.removeprefix("CU_DEVICE_ATTRIBUTE_"), 0))

    def cuDeviceCanAccessPeer(self, dev, peer):
        self._validate("cuDeviceCanAccessPeer", dev, peer)
        return (self.ok, 1)

    def cuDevicePrimaryCtxRetain(self, dev):
        self._validate("cuDevicePrimaryCtxRetain", dev)
        self.ctx_refs[int(dev)] += 1
        return (self.ok, self._real.CUcontext(0x1000 + int(dev)))

    def cuDevicePrimaryCtxRelease(self, dev):
        self._validate("cuDevicePrimaryCtxRelease", dev)
        self.ctx_refs[int(dev)] -= 1
        return (self.ok,)

    def cuCtxPushCurrent(self, ctx):
        self._validate("cuCtxPushCurrent", ctx)
        self.ctx_stack.append(int(ctx))
        return (self.ok,)

    def cuCtxPopCurrent(self):
        self._validate("cuCtxPopCurrent")
        return (self.ok, self._real.CUcontext(self.ctx_stack.pop()))

    def cuCtxGetStreamPriorityRange(self):
        self._validate("cuCtxGetStreamPriorityRange")
        return (self.ok, 0, -5)

    def cuCtxEnablePeerAccess(self, peer, flags):
        self._validate("cuCtxEnablePeerAccess", peer, flags)
        self._current()
        return (self.ok,)

    def cuGetErrorName(self, code):
        self._validate("cuGetErrorName", code)
        return (self.ok, code.name.encode())

    def cuGetErrorString(self, code):
        self._validate("cuGetErrorString", code)
        return (self.ok, b"fake description")

    # -- memory
    def cuMemGetInfo(self):
        self._validate("cuMemGetInfo")
        self._current()
        used = sum(n for _, n, k in self.memory.values() if k != "host")
        return (self.ok, self.total - used, self.total)

    def cuMemAlloc(self, size):
        self._validate("cuMemAlloc", size)
        self._current()
        try:
            return (self.ok, self._real.CUdeviceptr(self._alloc(size, "device")))
        except MemoryError:
            return (self._real.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)

    def cuMemFree(self, address):
        self._validate("cuMemFree", address)
        self._current()
        assert self.memory.pop(int(address))[2] == "device"
        return (self.ok,)

    def cuMemHostAlloc(self, size, flags):
        self._validate("cuMemHostAlloc", size, flags)
        return (self.ok, self._alloc(size, "host"))

    def cuMemFreeHost(self, address):
        self._validate("cuMemFreeHost", address)
        assert self.memory.pop(int(address))[2] == "host"
        return (self.ok,)

    def cuMemPoolCreate(self, props):
        self._validate("cuMemPoolCreate", props)
        self._current()
        handle = self._handle("pool")
        self.pools[handle] = {"used": 0, "reserved": 0, "threshold": 0}
        return (self.ok, self._real.CUmemoryPool(handle))

    def cuMemPoolDestroy(self, pool):
        self._validate("cuMemPoolDestroy", pool)
        assert self.pools.pop(int(pool))["used"] == 0
        self.live["pool"].discard(int(pool))
        return (self.ok,)

    def cuMemPoolSetAttribute(self, pool, attr, value):
        self._validate("cuMemPoolSetAttribute", pool, attr, value)
        self.pools[int(pool)]["threshold"] = int(value)
        return (self.ok,)

    def cuMemPoolGetAttribute(self, pool, attr):
        self._validate("cuMemPoolGetAttribute", pool, attr)
        state = self.pools[int(pool)]
        key = "used" if "USED" in attr.name else "reserved"
        return (self.ok, self._real.cuuint64_t(state[key]))

    def cuMemAllocFromPoolAsync(self, size, pool, stream):
        self._validate("cuMemAllocFromPoolAsync", size, pool, stream)
        state = self.pools[int(pool)]
        address = self._alloc(size, f"pool{int(pool)}")
        state["used"] += size
        state["reserved"] = max(state["reserved"], state["used"])
        return (self.ok, self._real.CUdeviceptr(address))

    def cuMemFreeAsync(self, address, stream):
        self._validate("cuMemFreeAsync", address, stream)
        _, size, kind = self.memory.pop(int(address))
        state = self.pools[int(kind.removeprefix("pool"))]
        state["used"] -= size
        if state["reserved"] > state["threshold"]:  # released at the next sync point, here at once
            state["reserved"] = max(state["used"], state["threshold"])
        return (self.ok,)

    def cuMemPoolTrimTo(self, pool, keep):
        self._validate("cuMemPoolTrimTo", pool, keep)
        state = self.pools[int(pool)]
        state["reserved"] = min(state["reserved"], max(state["used"], keep))
        return (self.ok,)

    # -- copies (synchronous memmoves)
    def _copy(self, name: str, dst, src, n, *rest) -> tuple:
        self._validate(name, dst, src, n, *rest)
        self._current()
        ctypes.memmove(int(dst), int(src), n)
        return (self.ok,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        return self._copy("cuMemcpyHtoDAsync", dst, src, n, stream)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self._copy("cuMemcpyDtoHAsync", dst, src, n, stream)

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        return self._copy("cuMemcpyDtoDAsync", dst, src, n, stream)

    def cuMemcpyPeerAsync(self, dst, dst_ctx, src, src_ctx, n, stream):
        self._validate("cuMemcpyPeerAsync", dst, dst_ctx, src, src_ctx, n, stream)
        ctypes.memmove(int(dst), int(src), n)
        return (self.ok,)

    # -- streams and events
    def cuStreamCreateWithPriority(self, flags, priority):
        self._validate("cuStreamCreateWithPriority", flags, priority)
        self._current()
        assert -5 <= priority <= 0
        return (self.ok, self._real.CUstream(self._handle("stream")))

    def cuStreamDestroy(self, stream):
        self._validate("cuStreamDestroy", stream)
        self.live["stream"].remove(int(stream))
        return (self.ok,)

    def cuStreamSynchronize(self, stream):
        self._validate("cuStreamSynchronize", stream)
        return (self.ok,)

    def cuStreamQuery(self, stream):
        self._validate("cuStreamQuery", stream)
        return (self.ok,)

    def cuStreamWaitEvent(self, stream, event, flags):
        self._validate("cuStreamWaitEvent", stream, event, flags)
        return (self.ok,)

    def cuEventCreate(self, flags):
        self._validate("cuEventCreate", flags)
        return (self.ok, self._real.CUevent(self._handle("event")))

    def cuEventDestroy(self, event):
        self._validate("cuEventDestroy", event)
        self.live["event"].remove(int(event))
        return (self.ok,)

    def cuEventRecord(self, event, stream):
        self._validate("cuEventRecord", event, stream)
        return (self.ok,)

    def cuEventQuery(self, event):
        self._validate("cuEventQuery", event)
        return (self.ok,)

    def cuEventSynchronize(self, event):
        self._validate("cuEventSynchronize", event)
        return (self.ok,)

    def cuEventElapsedTime(self, start, end):
        self._validate("cuEventElapsedTime", start, end)
        return (self.ok, 1.25)

    # -- modules and kernels
    def cuModuleLoadData(self, image):
        self._validate("cuModuleLoadData", image)
        assert image.endswith(b"\0")
        return (self.ok, self._real.CUmodule(self._handle("module")))

    def cuModuleUnload(self, module):
        self._validate("cuModuleUnload", module)
        self.live["module"].remove(int(module))
        return (self.ok,)

    def cuModuleGetFunction(self, module, name):
        self._validate("cuModuleGetFunction", module, name)
        if name != b"fill_u32":
            return (self._real.CUresult.CUDA_ERROR_NOT_FOUND, None)
        return (self.ok, self._real.CUfunction(self._handle("function")))

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self._validate("cuLaunchKernel", f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
        pointers = (ctypes.c_void_p * len(self.kernel_param_types)).from_address(params)
        values = [t.from_address(p).value for t, p in zip(self.kernel_param_types, pointers, strict=True)]
        self.launches.append(((gx, gy, gz, bx, by, bz, shared), values))
        return (self.ok,)


@pytest.fixture
def fake_driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    if not HAVE_CUDA_PYTHON:
        pytest.skip("cuda-python is not installed")
    if _probe()[0] is not None:
        pytest.skip("a GPU is present: the real calls would run (the gpu tests cover this)")
    real = cuda_backend._load_driver()
    fake = FakeDriver(real)
    monkeypatch.setattr(cuda_backend, "driver", fake)
    return fake


def test_fake_driver_walkthrough(fake_driver: FakeDriver) -> None:
    """Every runtime operation but `launch`/`view` (they need torch's CUDA) through the fake driver."""
    backend = cuda_backend.CudaBackend()
    assert backend.device_count() == 2
    rt = backend.open_runtime(0)
    props = rt.properties()
    assert (props.name, props.compute_units, props.extra["compute_capability"]) == ("Fake GPU 0", 132, (9, 0))
    assert rt.memory_info() == (fake_driver.total, fake_driver.total)

    # memory and accounting
    a = rt.mem_alloc(1000)
    assert rt.allocated_bytes() == aligned(1000)
    with pytest.raises(OutOfDeviceMemory) as oom:
        rt.mem_alloc(2 * fake_driver.total)
    assert oom.value.free == fake_driver.total - aligned(1000)
    rt.mem_free(a)
    with pytest.raises(InvalidAddress):
        rt.mem_free(a)
    assert rt.allocated_bytes() == 0

    # streams, pool
    s = rt.create_stream(priority=-100)
    assert s.priority == -5
    pool = rt.create_pool(release_threshold=4096)
    p = pool.alloc_async(1000, s)
    assert pool.used_bytes == aligned(1000) and rt.allocated_bytes() == pool.reserved_bytes
    pool.free_async(p, s)
    assert pool.used_bytes == 0 and pool.reserved_bytes == aligned(1000)
    pool.set_release_threshold(0)
    pool.trim_to(0)
    assert pool.reserved_bytes == 0

    # host buffers and copies
    n = 1000
    pattern = torch.arange(n, dtype=torch.int32).to(torch.uint8)
    host = rt.host_alloc(n)
    host.tensor().copy_(pattern)
    d1, d2 = rt.mem_alloc(n), rt.mem_alloc(n)
    rt.copy_htod_async(d1, host, n, s)
    rt.copy_dtod_async(d2, d1, n, s)
    out = torch.zeros(n + 8, dtype=torch.uint8)
    rt.copy_dtoh_async(out, d2, n, s, dst_offset=8)
    assert torch.equal(out[8:], pattern)
    rt.copy_htod_async(d1, pattern, 10, s, src_offset=3)
    unpinned = rt.host_alloc(10, pinned=False)
    rt.copy_dtoh_async(unpinned, d1, 10, s)
    assert torch.equal(unpinned.tensor(), pattern[3:13])

    # events
    e0, e1 = rt.create_event(), rt.create_event(timing=False)
    e0.record(s)
    e1.record(s)
    s.wait_event(e1)
    assert e0.query() and e1.query() and s.query()
    e0.synchronize()
    s.synchronize()
    assert e0.elapsed_ms(e1) == 1.25

    # modules and a capped launch: args + the cap, physical grid min(grid, cap)
    module = rt.load_module(b".version 7.0")
    function = rt.get_function(module, "fill_u32")
    with pytest.raises(cuda_backend.CudaError, match="CUDA_ERROR_NOT_FOUND"):
        rt.get_function(module, "missing")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    fake_driver.kernel_param_types = [u64, u64, u32, u32, ctypes.c_int32]
    rt.launch_function(s, function, 64, (128,), (d1, d2, ctypes.c_uint32(7), ctypes.c_uint32(n)), cu_cap=4)
    assert fake_driver.launches[-1] == ((4, 1, 1, 128, 1, 1, 0), [d1, d2, 7, n, 4])

    # peer copy to a second runtime, usage; streams are per device
    rt1 = backend.open_runtime(1)
    with pytest.raises(DeviceError, match="not 1"):
        rt1.copy_dtod_async(d1, d2, 4, s)
    d3 = rt1.mem_alloc(n)
    rt.copy_peer_async(d3, rt1, d2, n, s)
    assert ctypes.string_at(d3, n) == bytes(pattern.tolist())
    usage = backend.device_usage()
    assert [u.runtimes for u in usage] == [1, 1] and usage[0].streams == 1
    assert usage[1].used_memory >= aligned(n) and usage[0].name == "Fake GPU 0"  # the fake's memory is shared

    # close frees everything, leaves no context current and drops the context references
    pool.alloc_async(100, s)  # live at close
    rt.close()
    rt1.close()
    assert rt.closed and backend.runtimes() == []
    assert fake_driver.memory == {} and fake_driver.pools == {}
    assert all(not fake_driver.live[kind] for kind in ("stream", "event", "module", "pool"))
    assert fake_driver.ctx_stack == [] and fake_driver.ctx_refs == [0, 0]
    with pytest.raises(DeviceError):
        rt.mem_alloc(1)
    used = {name.split(".")[0] for name in cuda_backend.DRIVER_ENTRY_POINTS if name.startswith("cu")}
    used.discard("cuuint64_t")
    assert used - {"cuGetErrorName", "cuGetErrorString"} <= set(fake_driver.calls)


def test_fake_driver_init_failure(fake_driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        FakeDriver, "cuInit", lambda self, flags: (self._real.CUresult.CUDA_ERROR_NO_DEVICE,)
    )
    with pytest.raises(BackendUnavailable, match="CUDA_ERROR_NO_DEVICE"):
        cuda_backend.CudaBackend()
    monkeypatch.setattr(FakeDriver, "cuInit", lambda self, flags: (self.ok,))
    monkeypatch.setattr(FakeDriver, "cuDeviceGetCount", lambda self: (self.ok, 0))
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        cuda_backend.CudaBackend()


# ------------------------------------------------------------------------------------------------
# GPU


@pytest.fixture(scope="module")
def backend() -> cuda_backend.CudaBackend:
    return requires_gpu()


@pytest.fixture
def rt(backend: cuda_backend.CudaBackend):
    runtime = backend.open_runtime(0)
    try:
        yield runtime
    finally:
        runtime.close()


def _sleep(runtime: cuda_backend.CudaRuntime, stream, cycles: int = 200_000_000) -> None:
    """Keep `stream` busy for a while (~0.1 s)."""
    runtime.launch(stream, lambda: torch.cuda._sleep(cycles), name="sleep")


@gpu
def test_properties_and_memory_info(rt: cuda_backend.CudaRuntime) -> None:
    props = rt.properties()
    assert props.backend == "cuda" and props.index == 0 and props.name
    assert props.compute_units > 0 and props.total_memory > 0
    free, total = rt.memory_info()
    assert 0 < free <= total == props.total_memory
    assert rt.priority_range[0] <= rt.priority_range[1]


@gpu
def test_mem_alloc_accounting(rt: cuda_backend.CudaRuntime) -> None:
    base = rt.allocated_bytes()
    a = rt.mem_alloc(1000)
    b = rt.mem_alloc(3 * MiB)
    assert a % ALIGNMENT == 0 and b % ALIGNMENT == 0
    assert rt.allocated_bytes() == base + aligned(1000) + 3 * MiB
    rt.mem_free(a)
    assert rt.allocated_bytes() == base + 3 * MiB
    with pytest.raises(InvalidAddress):
        rt.mem_free(a)
    rt.mem_free(b)
    assert rt.allocated_bytes() == base
    _, total = rt.memory_info()
    with pytest.raises(OutOfDeviceMemory) as info:
        rt.mem_alloc(4 * total)
    assert info.value.requested == 4 * total and info.value.total == total
    assert rt.allocated_bytes() == base


@gpu
def test_mem_alloc_from_threads(rt: cuda_backend.CudaRuntime) -> None:
    base = rt.allocated_bytes()
    addresses: list[int] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(20):
            address = rt.mem_alloc(4096)
            with lock:
                addresses.append(address)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(addresses)) == 80
    assert rt.allocated_bytes() == base + 80 * 4096
    for address in addresses:
        rt.mem_free(address)
    assert rt.allocated_bytes() == base


@gpu
def test_pool_alloc_free_trim(rt: cuda_backend.CudaRuntime) -> None:
    stream = rt.create_stream()
    base = rt.allocated_bytes()
    pool = rt.create_pool(release_threshold=1 << 30)
    assert pool.reserved_bytes == 0 and pool.used_bytes == 0
    address = pool.alloc_async(1000, stream)
    assert address % ALIGNMENT == 0
    stream.synchronize()
    assert pool.used_bytes >= aligned(1000)
    assert pool.reserved_bytes >= pool.used_bytes
    assert rt.allocated_bytes() == base + pool.reserved_bytes
    pool.free_async(address, stream)
    with pytest.raises(InvalidAddress):
        pool.free_async(address, stream)
    stream.synchronize()
    assert pool.used_bytes == 0
    assert pool.reserved_bytes > 0  # kept: below the release threshold
    pool.trim_to(0)
    assert pool.reserved_bytes == 0
    assert rt.allocated_bytes() == base
    # A live allocation is released by destroy.
    pool.alloc_async(2 * MiB, stream)
    stream.synchronize()
    assert rt.allocated_bytes() > base
    pool.destroy()
    assert rt.allocated_bytes() == base


@gpu
def test_pool_release_threshold_zero_releases_at_sync(rt: cuda_backend.CudaRuntime) -> None:
    stream = rt.create_stream()
    pool = rt.create_pool(release_threshold=0)
    address = pool.alloc_async(8 * MiB, stream)
    pool.free_async(address, stream)
    stream.synchronize()
    assert pool.used_bytes == 0
    assert pool.reserved_bytes == 0
    pool.destroy()


@gpu
def test_htod_dtoh_round_trip(rt: cuda_backend.CudaRuntime) -> None:
    stream = rt.create_stream()
    n = 1 * MiB + 3
    pattern = torch.randint(0, 256, (n,), dtype=torch.uint8)
    src = rt.host_alloc(n)
    assert src.pinned and src.tensor().dtype == torch.uint8 and src.tensor().numel() == n
    src.tensor().copy_(pattern)
    d1, d2 = rt.mem_alloc(n), rt.mem_alloc(n)
    rt.copy_htod_async(d1, src, n, stream)
    rt.copy_dtod_async(d2, d1, n, stream)
    dst = rt.host_alloc(n)
    rt.copy_dtoh_async(dst, d2, n, stream)
    stream.synchronize()
    assert torch.equal(dst.tensor(), pattern)
    # Pageable: CPU tensors and unpinned buffers, with offsets.
    pageable = torch.zeros(n + 16, dtype=torch.uint8)
    rt.copy_dtoh_async(pageable, d2, n, stream, dst_offset=16)
    stream.synchronize()
    assert torch.equal(pageable[16:], pattern)
    unpinned = rt.host_alloc(n, pinned=False)
    rt.copy_htod_async(d1, pattern, 100, stream, src_offset=5)
    rt.copy_dtoh_async(unpinned, d1, 100, stream)
    stream.synchronize()
    assert torch.equal(unpinned.tensor()[:100], pattern[5:105])
    with pytest.raises(ValueError):
        rt.copy_htod_async(d1, src, n + 1, stream)
    src.free()
    src.free()  # idempotent, as in the emulated backend
    with pytest.raises(InvalidAddress):
        src.tensor()


@gpu
def test_event_ordering_across_streams(rt: cuda_backend.CudaRuntime) -> None:
    s1, s2 = rt.create_stream(), rt.create_stream(priority=-1)
    buf = rt.mem_alloc(4)
    value = rt.view(buf, torch.int32, (1,))
    rt.launch(s1, lambda: value.fill_(0))
    s1.synchronize()
    host = rt.host_alloc(4)
    _sleep(rt, s1)
    rt.launch(s1, lambda: value.fill_(7))
    done = rt.create_event(timing=False)
    done.record(s1)
    s2.wait_event(done)
    rt.copy_dtoh_async(host, buf, 4, s2)
    assert not done.query() and not s1.query() and not s2.query()
    s2.synchronize()
    assert done.query()
    assert host.tensor().view(torch.int32).item() == 7
    assert rt.create_event().query()  # never recorded: complete, as in CUDA


@gpu
def test_elapsed_time(rt: cuda_backend.CudaRuntime) -> None:
    stream = rt.create_stream()
    start, end = rt.create_event(), rt.create_event()
    start.record(stream)
    _sleep(rt, stream, 50_000_000)
    end.record(stream)
    end.synchronize()
    assert start.elapsed_ms(end) > 0.0
    untimed = rt.create_event(timing=False)
    untimed.record(stream)
    stream.synchronize()
    with pytest.raises(DeviceError):
        start.elapsed_ms(untimed)


@gpu
def test_view_and_launch_add(rt: cuda_backend.CudaRuntime) -> None:
    stream = rt.create_stream()
    n = 4096
    a, b, c = (rt.mem_alloc(n * 4) for _ in range(3))
    x = torch.arange(n, dtype=torch.float32)
    y = torch.full((n,), 2.5)
    rt.copy_htod_async(a, x, n * 4, stream)
    rt.copy_htod_async(b, y, n * 4, stream)
    va, vb, vc = (rt.view(p, torch.float32, (n,)) for p in (a, b, c))
    assert va.device == torch.device("cuda", 0) and va.data_ptr() == a
    rt.launch(stream, lambda: torch.add(va, vb, out=vc), blocks=n // 256, cu_cap=4, name="add")
    out = torch.empty(n)
    rt.copy_dtoh_async(out, c, n * 4, stream)
    stream.synchronize()
    assert torch.equal(out, x + y)
    strided = rt.view(a, torch.bfloat16, (4, 8), (1, 4))
    assert strided.dtype == torch.bfloat16 and strided.stride() == (1, 4) and strided.data_ptr() == a
    transposed = rt.view(a, torch.float32, (8, 4), (1, 8))
    rt.launch(stream, lambda: vc[:32].copy_(transposed.reshape(-1)))
    stream.synchronize()
    assert torch.equal(vc[:32].cpu(), x[:32].reshape(4, 8).t().reshape(-1))


PTX_FILL = rb"""
.version 7.0
.target sm_75
.address_size 64

.visible .entry fill_u32(
    .param .u64 fill_u32_out,
    .param .u64 fill_u32_meta,
    .param .u32 fill_u32_value,
    .param .u32 fill_u32_n,
    .param .u32 fill_u32_cap
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [fill_u32_out];
    ld.param.u64 %rd4, [fill_u32_meta];
    ld.param.u32 %r1, [fill_u32_value];
    ld.param.u32 %r2, [fill_u32_n];
    ld.param.u32 %r8, [fill_u32_cap];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd4, %rd4;
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mov.u32 %r7, %nctaid.x;
    or.b32 %r9, %r3, %r5;
    setp.ne.u32 %p2, %r9, 0;
    @%p2 bra START;
    st.global.u32 [%rd4], %r7;
    st.global.u32 [%rd4+4], %r8;
START:
    mad.lo.u32 %r6, %r3, %r4, %r5;
    mul.lo.u32 %r7, %r7, %r4;
LOOP:
    setp.ge.u32 %p1, %r6, %r2;
    @%p1 bra DONE;
    mul.wide.u32 %rd2, %r6, 4;
    add.u64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r1;
    add.u32 %r6, %r6, %r7;
    bra.uni LOOP;
DONE:
    ret;
}
"""


@gpu
@pytest.mark.parametrize(("grid", "cap"), [(64, 4), (2, 8)])
def test_launch_function_persistent_cap(rt: cuda_backend.CudaRuntime, grid: int, cap: int) -> None:
    """A grid-stride (persistent) kernel gets the cap as its last argument and min(grid, cap) blocks."""
    stream = rt.create_stream()
    module = rt.load_module(PTX_FILL)
    function = rt.get_function(module, "fill_u32")
    n = 64 * 128
    out, meta = rt.mem_alloc(n * 4), rt.mem_alloc(8)
    args = (out, meta, ctypes.c_uint32(0xABCD), ctypes.c_uint32(n))
    rt.launch_function(stream, function, grid, 128, args, cu_cap=cap)
    host = torch.zeros(n, dtype=torch.int32)
    info = torch.zeros(2, dtype=torch.int32)
    rt.copy_dtoh_async(host, out, n * 4, stream)
    rt.copy_dtoh_async(info, meta, 8, stream)
    stream.synchronize()
    assert bool((host == 0xABCD).all())
    assert info.tolist() == [min(grid, cap), cap]
    with pytest.raises(DeviceError):
        rt.get_function(module, "no_such_kernel")
    module.unload()


@gpu
def test_device_usage(backend: cuda_backend.CudaBackend, rt: cuda_backend.CudaRuntime) -> None:
    streams = [rt.create_stream() for _ in range(3)]
    buf = rt.mem_alloc(64 * MiB)
    usage = backend.device_usage()
    assert len(usage) == backend.device_count()
    mine = usage[0]
    assert mine.runtimes >= 1 and mine.streams >= len(streams)
    assert 64 * MiB <= mine.used_memory <= mine.total_memory
    rt.mem_free(buf)
    streams[0].destroy()
    assert backend.device_usage()[0].streams == mine.streams - 1


@gpu
def test_close_releases_everything(backend: cuda_backend.CudaBackend) -> None:
    runtime = backend.open_runtime(0)
    stream = runtime.create_stream()
    runtime.mem_alloc(MiB)
    pool = runtime.create_pool(release_threshold=1 << 30)
    pool.alloc_async(MiB, stream)
    runtime.host_alloc(4096)
    runtime.create_event().record(stream)
    assert runtime.allocated_bytes() >= 2 * MiB
    runtime.close()
    assert runtime.closed and runtime not in backend.runtimes()
    with pytest.raises(DeviceError):
        runtime.mem_alloc(256)
    runtime.close()  # idempotent


@gpu
def test_peer_copy(backend: cuda_backend.CudaBackend) -> None:
    if backend.device_count() < 2:
        pytest.skip("needs two GPUs")
    with backend.open_runtime(0) as rt0, backend.open_runtime(1) as rt1:
        n = 4 * MiB
        pattern = torch.randint(0, 256, (n,), dtype=torch.uint8)
        s0, s1 = rt0.create_stream(), rt1.create_stream()
        src, dst = rt0.mem_alloc(n), rt1.mem_alloc(n)
        rt0.copy_htod_async(src, pattern, n, s0)
        rt0.copy_peer_async(dst, rt1, src, n, s0)
        done = rt0.create_event(timing=False)
        done.record(s0)
        s1.wait_event(done)
        out = torch.empty(n, dtype=torch.uint8)
        rt1.copy_dtoh_async(out, dst, n, s1)
        s1.synchronize()
        assert torch.equal(out, pattern)


def test_an_mps_share_is_set_before_the_first_context_and_fixed_after(monkeypatch) -> None:
    env = cuda_backend.MPS_PERCENT_ENV
    monkeypatch.delenv(env, raising=False)
    cuda_backend._require_mps_share(40, first_context=True)
    assert os.environ[env] == "40"  # read by the driver when the context is created
    cuda_backend._require_mps_share(40, first_context=False)  # the same share: fine
    with pytest.raises(DeviceError, match="per process"):
        cuda_backend._require_mps_share(60, first_context=False)
    monkeypatch.delenv(env)
    with pytest.raises(DeviceError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=60"):
        cuda_backend._require_mps_share(60, first_context=False)  # too late for this process
    with pytest.raises(ValueError, match="1 to 100"):
        cuda_backend._require_mps_share(0, first_context=True)
