"""GPU partitioning of one proxy's runtime (INFless's GPU%, PTB semantics): a function that declares
`gpu_percent` has its kernels launched with a compute-unit cap, so instances of capped functions run
side by side on the device instead of taking turns.

Pure: `cu_cap_for` turns a share into a cap; `partitioning_of` says whether the backend holds kernels
to it. The emulated device enforces the cap (a kernel runs on at most `cu_cap` units and takes
`duration * full / units`, see device/gpu_schedule.py). On the CUDA backend only persistent-thread-block
kernels honour it; the plan executor's torch kernels choose their own SMs, and this build does not
create green contexts (`cuGreenCtxCreate`), so there the cap is advisory.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Partitioning", "cu_cap_for", "partitioning_of"]

Partitioning = Literal["enforced", "advisory"]


def cu_cap_for(gpu_percent: int | None, compute_units: int) -> int | None:
    """The compute units a `gpu_percent` share of a device with `compute_units` may use (rounded
    down, at least one); None (no cap) without a share."""
    if gpu_percent is None:
        return None
    if not 1 <= gpu_percent <= 100:
        raise ValueError(f"gpu_percent must be within 1..100, got {gpu_percent}")
    if compute_units < 1:
        raise ValueError(f"a device needs at least one compute unit, got {compute_units}")
    return max(1, compute_units * gpu_percent // 100)


def partitioning_of(backend: str) -> Partitioning:
    """Whether the backend called `backend` (`DeviceProperties.backend`) enforces compute-unit caps."""
    return "enforced" if backend == "emulated" else "advisory"
