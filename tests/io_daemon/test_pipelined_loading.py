"""Pipelined model loading through the executor's `on_kernel` hook: the results equal eager torch, every
kernel that first uses a weight starts only after that weight's event, and without the waits the same
run reads weights that have not arrived (so the check can fail)."""

from __future__ import annotations

import pytest
import torch

from streambox.api_proxy.device_tensor import DeviceTensor, download_tensor
from streambox.api_proxy.executor import DeviceModel, PlanExecutor, StreamPoolAllocator
from streambox.io_daemon import (
    CopyRequest,
    DaemonConfig,
    IODaemon,
    first_use,
    load_plan,
    weight_layout,
    weight_requests,
)
from streambox.kernel_compiler.zoo import example_input, get_entry

NAME = "resnet18"


@pytest.fixture(scope="module")
def plan(pool):
    return pool.get_or_lower(NAME, 1, get_entry(NAME).small_input_shape)


def test_first_use_orders_weights_by_the_first_compute_kernel_that_reads_them(plan):
    order = first_use(plan)
    assert sorted(order) == sorted(plan.weight_names)
    assert list(order.values()) == sorted(order.values())
    for name, index in order.items():
        kernel = plan.kernels[index]
        assert kernel.kind != "view" and name in kernel.accesses
        assert not any(name in k.accesses for k in plan.kernels[:index] if k.kind != "view")
    requests = weight_requests(plan, dict.fromkeys(plan.weight_names, 0))
    assert [r.layer for r in requests] == list(order.values())
    assert sum(r.nbytes for r in requests) == plan.weight_bytes
    with pytest.raises(KeyError, match="no device address"):
        weight_requests(plan, {})


def _cold_model(rt, plan, allocator, stream, arena: bool) -> DeviceModel:
    """Weights allocated but not loaded: poisoned with NaN so a kernel that reads too early shows.
    `arena`: all weights in one region laid out by `weight_layout` (else one allocation each)."""
    offsets, total = weight_layout(plan)
    base = allocator.allocate(total, stream) if arena else None
    weights = {}
    for var in plan.vars_of_kind("weight"):
        address = base + offsets[var.name] if arena else allocator.allocate(var.nbytes, stream)
        weights[var.name] = DeviceTensor(
            address, var.torch_dtype, tuple(var.shape), tuple(var.strides), var.nbytes
        )
        rt.view(address, torch.uint8, (var.nbytes,)).fill_(0xFF)  # all-ones floats are NaN
    return DeviceModel(plan, weights, {n: t.view(rt) for n, t in weights.items()})


def _run(rt, plan, config, *, wait: bool, arena: bool = False):
    allocator = StreamPoolAllocator(rt)
    stream = rt.create_stream()
    model = _cold_model(rt, plan, allocator, stream, arena)
    x = example_input(NAME, 1, get_entry(NAME).small_input_shape)
    nbytes = x.numel() * x.element_size()
    handle = DeviceTensor(
        allocator.allocate(nbytes, stream), x.dtype, tuple(x.shape), tuple(x.stride()), nbytes
    )
    with IODaemon(rt, config) as daemon:
        load = load_plan(
            daemon,
            "f",
            plan,
            {n: t.address for n, t in model.weights.items()},
            inputs=[CopyRequest(handle.address, x, nbytes, "input")],  # the request's input, too
        )
        hook = load.on_kernel(stream) if wait else None
        result = PlanExecutor(rt, allocator).run(model, {plan.inputs[0]: handle}, stream, on_kernel=hook)
        result.done.synchronize()
        out = download_tensor(rt, result.outputs[plan.outputs[0]], stream)
        load.synchronize()
        events = {i: e for i in range(len(plan.kernels)) if (e := load.event_for(i)) is not None}
        assert set(events) == {i for i in load.layers if i < len(plan.kernels)}
        calls = daemon.stats.copy_calls
    return x, out, stream, events, calls


@pytest.mark.parametrize("mode,arena", [("streambox", False), ("streambox", True), ("stream-only", False)])
def test_pipelined_run_equals_eager_torch_and_no_kernel_runs_before_its_weights(
    plan, zoo_model, rt, mode, arena
):
    config = DaemonConfig(mode=mode)
    rt.clear_timeline()
    x, out, stream, events, calls = _run(rt, plan, config, wait=True, arena=arena)
    with torch.no_grad():
        want = zoo_model(NAME)(x)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)

    # each compute kernel's timeline record, in plan order
    kernels = [r for r in rt.timeline() if r.lane == f"stream:{stream.id}" and r.kind == "kernel"]
    compute = [i for i, k in enumerate(plan.kernels) if k.kind != "view"]
    assert [r.name for r in kernels] == [plan.kernels[i].name for i in compute]
    start_of = dict(zip(compute, (r.start for r in kernels), strict=True))
    for index, event in events.items():
        assert start_of[index] >= event.marker.time, plan.kernels[index].name
    # the loading really was pipelined: the first kernel ran before the last weight arrived
    last = max(e.marker.time for e in events.values())
    assert start_of[compute[0]] < last
    if mode == "stream-only":
        assert calls == len(plan.weight_names) + 1  # one call per request, input included
    elif arena:  # fused small weights laid out in one region go out as one call per block
        assert calls < len(plan.weight_names) // 2


def test_weight_layout_is_aligned_disjoint_and_in_first_use_order(plan):
    offsets, total = weight_layout(plan)
    assert list(offsets) == list(first_use(plan))
    spans = sorted((o, o + plan.variables[n].nbytes) for n, o in offsets.items())
    assert all(o % 256 == 0 for o, _ in spans)
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= total < spans[-1][1] + 256


def test_without_the_waits_kernels_read_weights_that_have_not_arrived(plan, zoo_model, rt):
    x, out, _, _, _ = _run(rt, plan, DaemonConfig(), wait=False)
    with torch.no_grad():
        want = zoo_model(NAME)(x)
    assert not torch.allclose(out, want, rtol=1e-4, atol=1e-5, equal_nan=False)
