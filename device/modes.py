"""Execution modes of the emulated device, and how a run chooses one.

- `functional`: real bytes in host memory, kernels run on the CPU and take CPU time; copies follow
  the link model. The default of the library and the tests: results are real.
- `timed`: GPU time. Kernels occupy their stream and compute units for their modelled duration
  (`launch(..., duration_s=...)`), copies follow the link model, and data is phantom: no bytes move,
  device memory is accounted but not backed, downloads return zeros. The default of `replay` and
  `burst`, whose results are times and memory, not values.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

DEVICE_MODES = ("functional", "timed")
DEFAULT_DEVICE_MODE = "functional"
ENV_DEVICE_MODE = "STREAMBOX_DEVICE_MODE"


def check_device_mode(mode: str, where: str = "device mode") -> str:
    """`mode` if it is a known mode, else a ValueError naming `where` and the allowed values."""
    if mode not in DEVICE_MODES:
        raise ValueError(f"{where}: {mode!r} is not a device mode; choose one of: {', '.join(DEVICE_MODES)}")
    return mode


def env_device_mode(default: str = DEFAULT_DEVICE_MODE) -> str:
    """`$STREAMBOX_DEVICE_MODE` when set (checked), else `default`."""
    value = os.environ.get(ENV_DEVICE_MODE, "").strip()
    return check_device_mode(value, f"${ENV_DEVICE_MODE}") if value else check_device_mode(default)


@contextlib.contextmanager
def device_mode_env(mode: str) -> Iterator[str]:
    """Run a block with `$STREAMBOX_DEVICE_MODE` = `mode`, so that the processes it starts (API
    proxies, monolithic instances) and the configs it builds from the environment follow the run."""
    check_device_mode(mode)
    before = os.environ.get(ENV_DEVICE_MODE)
    os.environ[ENV_DEVICE_MODE] = mode
    try:
        yield mode
    finally:
        if before is None:
            os.environ.pop(ENV_DEVICE_MODE, None)
        else:
            os.environ[ENV_DEVICE_MODE] = before


def describe_device_mode(mode: str, backend: str = "emulated") -> str:
    """One line for a command's output: the emulator's mode, or the real GPU's backend."""
    if backend != "emulated":  # the mode is the emulator's: a GPU's times and bytes are its own
        return f"device: the {backend} backend, a real GPU (its own times and bytes; no device mode applies)"
    if mode == "timed":
        return (
            "device mode: timed (GPU time: modelled kernel and copy times, phantom data; "
            "--device-mode functional runs the kernels for real)"
        )
    return "device mode: functional (kernels run on the CPU over real bytes; --device-mode timed: GPU time)"
