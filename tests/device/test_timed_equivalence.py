"""Timed mode changes time and data, never memory: the executor runs the same zoo model plan in both
modes and makes the same allocations, with the same pool curve."""

from __future__ import annotations

import threading

from streambox.api_proxy.device_tensor import upload_tensor
from streambox.api_proxy.executor import PlanExecutor, StreamPoolAllocator, upload_model
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, GiB
from streambox.kernel_compiler.zoo import example_input, get_entry

SPEC = V100_16GB.with_overrides(total_memory=4 * GiB, context_create_s=0.0, context_memory=0)
MODEL = "resnet18"


class Recording(StreamPoolAllocator):
    """The device pool, noting every allocation (with the pool's state after it) and free. A free's
    effect is noted only at the next synchronize: when the stream reaches it is timing, not memory."""

    def __init__(self, runtime) -> None:
        super().__init__(runtime)
        self.events: list[tuple] = []
        self._names: dict[int, int] = {}  # address -> first-seen order: addresses differ per run

    def _name(self, address: int) -> int:
        return self._names.setdefault(address, len(self._names))

    def allocate(self, nbytes, stream):
        address = super().allocate(nbytes, stream)
        pool = self.pool
        self.events.append(("alloc", nbytes, self._name(address), pool.used_bytes, pool.reserved_bytes))
        return address

    def free(self, address, stream):
        super().free(address, stream)
        self.events.append(("free", self._name(address)))


def _run(tmp_path, pool, mode: str) -> tuple[list[tuple], list[int]]:
    backend = EmulatedBackend(spec=SPEC, state_dir=tmp_path / mode, mode=mode)
    rt = backend.open_runtime(0)
    shape = get_entry(MODEL).small_input_shape
    plan = pool.get_or_lower(MODEL, 1, shape)
    allocator = Recording(rt)
    stream = rt.create_stream()
    model = upload_model(rt, plan, allocator, stream)
    x = upload_tensor(rt, example_input(MODEL, 1, shape), allocator.allocate, stream)
    stream.synchronize()
    executor = PlanExecutor(rt, allocator)
    curve = []
    for _ in range(2):  # cold, then warm (cached blocks reused)
        # Hold the stream while the run is issued, so that no free is reached meanwhile, in either
        # mode: the allocation sequence then depends on the plan alone.
        release = threading.Event()
        if mode == "functional":
            rt.launch(stream, lambda release=release: release.wait(30), name="hold")
        else:
            rt.launch(stream, lambda: None, duration_s=0.5, name="hold")
        result = executor.run(model, {plan.inputs[0]: x}, stream)
        release.set()
        result.done.synchronize()
        curve.append(allocator.pool.used_bytes)
        for out in result.outputs.values():
            allocator.free(out.address, stream)
        stream.synchronize()
        curve.append(allocator.pool.reserved_bytes)
    used = backend.device_usage()[0].used_memory
    rt.close()
    return allocator.events, curve + [used]


def test_same_plan_same_allocations_and_pool_curve_in_both_modes(tmp_path, pool):
    functional = _run(tmp_path, pool, "functional")
    timed = _run(tmp_path, pool, "timed")
    assert len(functional[0]) > 50
    assert timed[0] == functional[0]
    assert timed[1] == functional[1]
