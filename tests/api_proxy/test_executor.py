"""The plan executor on the emulated GPU: same results as eager torch, exact memory behaviour."""

from __future__ import annotations

import pytest
import torch

from streambox.api_proxy.device_tensor import download_tensor, upload_tensor
from streambox.api_proxy.executor import PlanExecutor, StreamPoolAllocator, free_model, upload_model
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, GiB
from streambox.kernel_compiler.memory_profile import profile_plan
from streambox.kernel_compiler.zoo import ZOO, example_input, get_entry

SPEC = V100_16GB.with_overrides(total_memory=4 * GiB, context_create_s=0.0, context_memory=0)


@pytest.fixture
def runtime(tmp_path):
    backend = EmulatedBackend(spec=SPEC, count=1, state_dir=tmp_path / "state")
    with backend.open_runtime(0) as rt:
        yield rt


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_matches_eager_torch(name, pool, zoo_model, runtime):
    shape = get_entry(name).small_input_shape
    plan = pool.get_or_lower(name, 1, shape)
    allocator = StreamPoolAllocator(runtime)
    stream = runtime.create_stream()
    model = upload_model(runtime, plan, allocator, stream)
    x = example_input(name, 1, shape)
    handle = upload_tensor(runtime, x, allocator.allocate, stream)

    result = PlanExecutor(runtime, allocator).run(model, {plan.inputs[0]: handle}, stream)
    got = [download_tensor(runtime, result.outputs[n], stream) for n in plan.outputs]

    with torch.no_grad():
        want = zoo_model(name)(x)
    want = list(want) if isinstance(want, tuple | list) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **_tolerance(w.dtype))

    # The executor's live bytes follow the offline profile exactly (same lazy/eager rule).
    assert result.stats.peak_live_bytes == profile_plan(plan).peak_eager
    assert result.stats.kernels == sum(k.kind != "view" for k in plan.kernels)

    for out in result.outputs.values():
        allocator.free(out.address, stream)
    allocator.free(handle.address, stream)
    free_model(model, allocator, stream)
    stream.synchronize()
    assert allocator.pool.used_bytes == 0


def test_eager_recycling_lowers_the_peak_and_frees_everything(pool, runtime):
    name = "resnet18"
    shape = get_entry(name).small_input_shape
    plan = pool.get_or_lower(name, 1, shape)
    allocator = StreamPoolAllocator(runtime)
    stream = runtime.create_stream()
    model = upload_model(runtime, plan, allocator, stream)
    handle = upload_tensor(runtime, example_input(name, 1, shape), allocator.allocate, stream)
    profile = profile_plan(plan)
    peaks = {}
    outputs = {}
    for eager in (True, False):
        result = PlanExecutor(runtime, allocator, eager_recycling=eager).run(
            model, {plan.inputs[0]: handle}, stream
        )
        peaks[eager] = result.stats.peak_live_bytes
        outputs[eager] = download_tensor(runtime, result.outputs[plan.outputs[0]], stream)
        for out in result.outputs.values():
            allocator.free(out.address, stream)
    torch.testing.assert_close(outputs[True], outputs[False], rtol=0, atol=0)
    assert peaks[True] == profile.peak_eager
    assert peaks[False] == profile.peak_no_eager
    assert peaks[True] < peaks[False]
    allocator.free(handle.address, stream)
    free_model(model, allocator, stream)
    stream.synchronize()
    assert allocator.pool.used_bytes == 0
    allocator.pool.trim_to(0)
    assert allocator.pool.reserved_bytes == 0


def test_profiled_run_times_every_kernel(pool, runtime):
    plan = pool.get_or_lower("alexnet", 1, get_entry("alexnet").small_input_shape)
    allocator = StreamPoolAllocator(runtime)
    stream = runtime.create_stream()
    model = upload_model(runtime, plan, allocator, stream)
    x = example_input("alexnet", 1, get_entry("alexnet").small_input_shape)
    handle = upload_tensor(runtime, x, allocator.allocate, stream)
    executor = PlanExecutor(runtime, allocator)
    result = executor.run(model, {plan.inputs[0]: handle}, stream, profile=True)
    seconds = result.kernel_seconds()
    assert len(seconds) == result.stats.kernels
    assert all(s >= 0 for s in seconds) and sum(seconds) > 0


def test_missing_input_is_named(pool, runtime):
    plan = pool.get_or_lower("alexnet", 1, get_entry("alexnet").small_input_shape)
    allocator = StreamPoolAllocator(runtime)
    stream = runtime.create_stream()
    model = upload_model(runtime, plan, allocator, stream)
    with pytest.raises(KeyError, match="missing inputs"):
        PlanExecutor(runtime, allocator).run(model, {}, stream)
