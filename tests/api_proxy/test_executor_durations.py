"""The executor hands every compute kernel its seconds for the runtime's preset (`duration_s`)."""

from __future__ import annotations

import pytest

from streambox.api_proxy.device_tensor import upload_tensor
from streambox.api_proxy.executor import PlanExecutor, StreamPoolAllocator, free_model, upload_model
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, GiB
from streambox.kernel_compiler.zoo import example_input, get_entry


def _run(runtime, pool, name: str) -> None:
    shape = get_entry(name).small_input_shape
    plan = pool.get_or_lower(name, 1, shape)
    allocator = StreamPoolAllocator(runtime)
    stream = runtime.create_stream()
    model = upload_model(runtime, plan, allocator, stream)
    x = upload_tensor(runtime, example_input(name, 1, shape), allocator.allocate, stream)
    result = PlanExecutor(runtime, allocator).run(model, {plan.inputs[0]: x}, stream)
    result.done.synchronize()
    for out in result.outputs.values():
        allocator.free(out.address, stream)
    allocator.free(x.address, stream)
    free_model(model, allocator, stream)
    stream.synchronize()


@pytest.mark.parametrize(("spec_name", "preset"), [(V100_16GB.name, "v100-16gb"), ("test-gpu", None)])
def test_each_compute_kernel_gets_its_seconds_for_the_runtimes_preset(
    tmp_path, pool, monkeypatch, spec_name, preset
):
    spec = V100_16GB.with_overrides(
        name=spec_name, total_memory=2 * GiB, context_create_s=0.0, context_memory=0
    )
    backend = EmulatedBackend(spec=spec, count=1, state_dir=tmp_path / "state")
    launched: list[tuple[str, float | None]] = []
    with backend.open_runtime(0) as runtime:
        launch = runtime.launch

        def noting(stream, kernel, *, duration_s=None, name="kernel", **options) -> None:
            launched.append((name, duration_s))  # what the executor asked for; the real launch runs it
            launch(stream, kernel, duration_s=duration_s, name=name, **options)

        monkeypatch.setattr(runtime, "launch", noting)
        _run(runtime, pool, "resnet18")
    backend.close()
    plan = pool.get_or_lower("resnet18", 1, get_entry("resnet18").small_input_shape)
    seconds = plan.kernel_seconds("v100-16gb")
    compute = [(k.name, s) for k, s in zip(plan.kernels, seconds, strict=True) if k.kind == "compute"]
    if preset is None:
        assert launched == [(name, None) for name, _ in compute]
    else:
        assert launched == compute and all(s > 0 for _, s in launched)
