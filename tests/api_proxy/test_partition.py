"""GPU partitioning at run time: a function's `gpu_percent` becomes its kernels' compute-unit cap,
which the emulated device enforces in timed mode (capped functions overlap, each kernel slower)."""

from __future__ import annotations

import threading

import pytest

from streambox.api_proxy.device_tensor import upload_tensor
from streambox.api_proxy.partition import cu_cap_for, partitioning_of
from streambox.api_proxy.plan_program import PlanProgram
from streambox.api_proxy.proxy_memory import MemoryOptions, ProxyMemory
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, GiB
from streambox.kernel_compiler.zoo import example_input, get_entry
from streambox.memory_pool.modes import PoolMode

SPEC = V100_16GB.with_overrides(total_memory=4 * GiB, context_create_s=0.0, context_memory=0)
MODEL = "resnet18"  # at its full input shape, half of its kernels fill all 80 units of a V100


def test_a_share_is_a_whole_number_of_units_and_at_least_one():
    assert cu_cap_for(None, 80) is None
    assert cu_cap_for(50, 80) == 40 and cu_cap_for(100, 80) == 80 and cu_cap_for(1, 80) == 1
    assert cu_cap_for(33, 80) == 26  # rounded down: never more than the share
    with pytest.raises(ValueError, match="within 1..100"):
        cu_cap_for(0, 80)
    assert partitioning_of("emulated") == "enforced" and partitioning_of("cuda") == "advisory"


def _kernel_records(runtime, lane):
    return [r for r in runtime.timeline() if r.kind == "kernel" and r.lane == lane and r.name != "gate"]


@pytest.mark.parametrize("gpu_percent", [None, 50])
def test_two_functions_at_half_the_gpu_overlap_and_each_kernel_is_twice_as_long(gpu_percent, pool, tmp_path):
    plan = pool.get_or_lower(MODEL, 1, get_entry(MODEL).input_shape)
    program = PlanProgram.of(plan, plan.kernel_seconds("v100-16gb"))
    launched = [k for k in program.kernels if k.compute]
    backend = EmulatedBackend(spec=SPEC, count=1, state_dir=tmp_path / "state", mode="timed")
    runtime = backend.open_runtime(0)
    units = runtime.properties().compute_units
    cap = cu_cap_for(gpu_percent, units)
    options = MemoryOptions(mode=PoolMode.FM, keep_alive_s=60.0)
    x = example_input(MODEL, 1, tuple(plan.input_shape))
    with ProxyMemory(runtime, options) as memory:
        streams = [runtime.create_stream() for _ in range(2)]
        gate_stream = runtime.create_stream()
        barrier = threading.Barrier(2)
        gates = []

        def open_gate() -> None:  # both functions' kernels wait for it: they start together on the GPU
            runtime.clear_timeline()
            runtime.launch(gate_stream, lambda: None, blocks=1, duration_s=0.05, name="gate")
            gates.append(runtime.create_event(timing=False))
            gates[-1].record(gate_stream)

        def function(index: int) -> None:
            s = streams[index]
            for _ in range(2):  # a warm run (weights, bound kernels), then the one measured
                handle = upload_tensor(runtime, x, memory.pool.allocate, s)
                s.synchronize()
                if barrier.wait() == 0:
                    open_gate()
                barrier.wait()
                s.wait_event(gates[-1])
                result = memory.infer(f"f{index}", plan, {plan.inputs[0]: handle}, s, cu_cap=cap)
                s.synchronize()
                memory.pool.free_many([handle.address, *(t.address for t in result.outputs.values())], s)

        threads = [threading.Thread(target=function, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        records = [_kernel_records(runtime, s.lane) for s in streams]
        for s in streams:
            s.synchronize()
    runtime.close()
    backend.close()

    wide = []  # (record, its full-GPU time) of the kernels whose grid fills the whole device
    for lane in records:
        assert [r.name for r in lane] == [k.kernel.name for k in launched]
        wide.append([(r, k.duration_s) for r, k in zip(lane, launched, strict=True) if k.blocks >= units])
    assert len(wide[0]) >= 10
    stretch = [(r.end - r.start) / full for lane in wide for r, full in lane]
    spans = [(lane[0].start, lane[-1].end) for lane in records]
    shared = min(e for _, e in spans) - max(b for b, _ in spans)
    shorter = min(e - b for b, e in spans)
    if gpu_percent is None:  # a whole-GPU kernel takes the units it finds free: all of them, mostly
        assert any(r.compute_units == units for lane in wide for r, _ in lane)
        assert stretch == pytest.approx([units / r.compute_units for lane in wide for r, _ in lane])
    else:  # each at half the units: twice as long, and side by side with the other function's
        assert all(r.compute_units == cap == units // 2 for lane in wide for r, _ in lane)
        assert stretch == pytest.approx([2.0] * len(stretch))
        overlapping = [
            (a, b)
            for a, _ in wide[0]
            for b, _ in wide[1]
            if a.start < b.end - 1e-9 and b.start < a.end - 1e-9
        ]
        assert overlapping and shared > shorter / 2, (spans, len(overlapping))
