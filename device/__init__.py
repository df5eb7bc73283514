"""The GPU-runtime layer: one interface (`base.py`), an emulated backend (default; `functional` or
`timed`, see `modes.py`) and a CUDA backend.

Backends are imported lazily so that importing `streambox.device` never loads a CUDA library.
"""

from __future__ import annotations

from typing import Any

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
    KernelLaunch,
    MemoryPool,
    OutOfDeviceMemory,
    Runtime,
    Stream,
    TimelineRecord,
    aligned,
)
from .modes import DEVICE_MODES
from .specs import PRESETS, DeviceSpec, LinkModel, preset

BACKENDS = ("emulated", "cuda")


def get_backend(name: str = "emulated", **options: Any) -> Backend:
    """Open the named backend. Options go to its constructor (emulated: spec, count, state_dir, mode,
    framework)."""
    if name == "emulated":
        from .emulated import EmulatedBackend

        return EmulatedBackend(**options)
    if name == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(**options)
    raise ValueError(f"unknown device backend {name!r}; choose one of: {', '.join(BACKENDS)}")


__all__ = [
    "ALIGNMENT",
    "BACKENDS",
    "DEVICE_MODES",
    "PRESETS",
    "Backend",
    "BackendUnavailable",
    "DeviceError",
    "DeviceProperties",
    "DeviceSpec",
    "DeviceUsage",
    "Event",
    "HostBuffer",
    "InvalidAddress",
    "KernelLaunch",
    "LinkModel",
    "MemoryPool",
    "OutOfDeviceMemory",
    "Runtime",
    "Stream",
    "TimelineRecord",
    "aligned",
    "get_backend",
    "preset",
]
