"""Kernel run times on the device, stored into the memory profile beside the plan.

Algorithm 1 needs, per kernel, the bytes live while it runs (the kernel compiler's memory profile,
`live_eager`) and how long it runs. The run times come from a profiled run of the executor (events
around each kernel) on the configured device; `profile_on_device` measures them once (median of a
few runs after a warm-up) and stores them in `MemoryProfile.runtime_s` through the model pool.
View kernels do no device work: 0 s.

`device_profile(model_pool, plan, device_name)` is the offline profile a proxy deploys with: the
plan's memory per kernel, and per kernel the time `KernelPlan.kernel_seconds(preset)` gives for the
preset modelling that device (GPU-measured times where a calibration exists, else the cost model),
cached beside the plan in the model pool. Where no preset models the device, a profile measured on
it (`profile_on_device`) is used; without one, `NoProfile` says why.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping

from streambox.device import Runtime, Stream
from streambox.kernel_compiler.cost_model import preset_for_device
from streambox.kernel_compiler.memory_profile import MemoryProfile
from streambox.kernel_compiler.model_pool import ModelPool
from streambox.kernel_compiler.plan import KernelPlan
from streambox.kernel_compiler.zoo import example_input
from streambox.memory_pool.pool import DeviceMemoryPool, PoolConfig

from .device_tensor import DeviceTensor, upload_tensor
from .executor import DeviceModel, PlanExecutor, free_all, free_model, upload_model

__all__ = [
    "NoProfile", "device_profile", "measure_kernel_runtimes", "measure_plan_on_device", "measured_source",
    "profile_on_device",
]


class NoProfile(LookupError):
    """No kernel run times can be had for a plan on a device (the message says why)."""


def measured_source(device_name: str) -> str:
    """`MemoryProfile.runtime_source` of times measured on the device called `device_name`."""
    return f"measured:{device_name}"


def device_profile(model_pool: ModelPool, plan: KernelPlan, device_name: str) -> MemoryProfile:
    """`plan`'s memory profile with kernel run times for the device called `device_name` (see the
    module doc); computed once per plan and device, then read from the model pool."""
    profile = model_pool.profile(plan.model, plan.batch, tuple(plan.input_shape))
    preset = preset_for_device(device_name)
    # A preset's times are what a timed device lasts (and a calibration's what the GPU measured);
    # times measured on the device serve where no preset models it.
    wanted = preset if preset is not None else measured_source(device_name)
    if profile.runtime_s is not None and profile.runtime_source == wanted:
        return profile
    if preset is None:
        raise NoProfile(
            f"no cost-model preset models device {device_name!r} and no run times were measured on it "
            f"for {plan.model} (batch {plan.batch}); measure them with api_proxy.profiling.profile_on_device"
        )
    profile.runtime_s = plan.kernel_seconds(preset)
    profile.runtime_source = preset
    model_pool.store_profile(profile)
    return profile


def measure_kernel_runtimes(
    executor: PlanExecutor,
    model: DeviceModel,
    inputs: Mapping[str, DeviceTensor],
    stream: Stream,
    *,
    repeats: int = 3,
    warmup: int = 1,
) -> list[float]:
    """Median device seconds of every plan kernel over `repeats` profiled runs (0.0 for views)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    samples = []
    for i in range(warmup + repeats):
        result = executor.run(model, inputs, stream, profile=True)
        seconds = result.plan_kernel_seconds()
        free_all(executor.allocator, [t.address for t in result.outputs.values()], stream, fence=True)
        if i >= warmup:
            samples.append(seconds)
    return [statistics.median(column) for column in zip(*samples, strict=True)]


def measure_plan_on_device(
    runtime: Runtime,
    plan: KernelPlan,
    *,
    repeats: int = 3,
    executor: Callable[[Runtime, DeviceMemoryPool], PlanExecutor] = PlanExecutor,
) -> list[float]:
    """`measure_kernel_runtimes` of `plan` on its example input, uploaded to `runtime` in a private
    pool that is freed after; `executor` builds the executor that runs it (gpu_check gates it).

    The pool grows rather than make the host wait for the device (no waiting for its own frees, no
    run-ahead bound): on a GPU, gpu_check's gate holds the stream while the host issues the run, and a
    wait mid-issue lasts until the gate ends, after which the events would time the host's issuing
    (first H200 run: resnet50 33 ms, mobilenet_v3_small 30 ms, against resnet18's 1 ms)."""
    config = PoolConfig(metrics=False, wait_own_frees=False, run_ahead_bytes=None)
    pool = DeviceMemoryPool(runtime, config)
    stream = runtime.create_stream()
    try:
        device_model = upload_model(runtime, plan, pool, stream)
        example = example_input(plan.model, plan.batch, tuple(plan.input_shape))
        x = upload_tensor(runtime, example, pool.allocate, stream)
        seconds = measure_kernel_runtimes(
            executor(runtime, pool), device_model, {plan.inputs[0]: x}, stream, repeats=repeats
        )
        pool.free(x.address, stream)
        free_model(device_model, pool, stream)
        stream.synchronize()
    finally:
        pool.close()
        stream.destroy()
    return seconds


def profile_on_device(
    model_pool: ModelPool,
    runtime: Runtime,
    model: str,
    batch: int,
    input_shape: tuple[int, ...] | None = None,
    *,
    repeats: int = 3,
    force: bool = False,
) -> MemoryProfile:
    """The plan's memory profile with kernel run times measured on `runtime` (stored; reused later
    unless `force`)."""
    profile = model_pool.profile(model, batch, input_shape)
    if profile.runtime_s is not None and not force:
        return profile
    plan = model_pool.get_or_lower(model, batch, input_shape)
    profile.runtime_s = measure_plan_on_device(runtime, plan, repeats=repeats)
    profile.runtime_source = measured_source(runtime.properties().name)
    model_pool.store_profile(profile)
    return profile
