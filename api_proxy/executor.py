"""Running a kernel plan on a stream of a device.

The executor walks a plan in order. For each kernel it allocates the storage variables the kernel
touches for the first time (lazy allocation: an intermediate's first access is the kernel that
produces it), builds tensor views over device memory, launches the kernel on the stream, counts one
access per touched variable, and frees an intermediate the moment its count reaches the plan's
expected count (eager recycling). Frees are stream-ordered, so a buffer returns to the allocator only
after the kernels issued before the free have run.

Device bytes come from an `Allocator`. `StreamPoolAllocator` (the device's stream-ordered pool) is the
simple one; the memory pool component provides the auto-scaling one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from streambox.device import Event, MemoryPool, Runtime, Stream
from streambox.kernel_compiler.ops import invoke_kernel
from streambox.kernel_compiler.plan import Kernel, KernelPlan, VarSpec

from .device_tensor import DeviceTensor, upload_tensor

#: Threads per block times elements per thread of a typical elementwise kernel: the emulated grid size.
ELEMENTS_PER_BLOCK = 1024


class Allocator(Protocol):
    """Where the executor takes device bytes from (stream-ordered)."""

    def allocate(self, nbytes: int, stream: Stream) -> int: ...

    def free(self, address: int, stream: Stream) -> None: ...


class StreamPoolAllocator:
    """The device's stream-ordered pool (cuMemPool-like), one per runtime: the simple allocator."""

    def __init__(self, runtime: Runtime, release_threshold: int = 0) -> None:
        self.pool: MemoryPool = runtime.create_pool(release_threshold)

    def allocate(self, nbytes: int, stream: Stream) -> int:
        return self.pool.alloc_async(nbytes, stream)

    def free(self, address: int, stream: Stream) -> None:
        self.pool.free_async(address, stream)


@dataclass
class DeviceModel:
    """A plan whose weights are resident on one device."""

    plan: KernelPlan
    weights: dict[str, DeviceTensor]
    # Tensor views over the resident weights, built once: a run only makes views of what it allocates.
    weight_views: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights.values())


@dataclass
class RunStats:
    kernels: int = 0
    peak_live_bytes: int = 0  # intermediates and outputs held at once by this run
    allocations: int = 0
    issue_seconds: float = 0.0  # host time spent issuing the plan
    # Per-kernel device time, filled when the run was asked to profile (events around each kernel).
    kernel_seconds: list[float] | None = None


@dataclass
class RunResult:
    outputs: dict[str, DeviceTensor]
    stats: RunStats
    done: Event  # completes when the last kernel has run: poll it instead of syncing the stream
    _events: list[Event] = field(default_factory=list, repr=False)

    def kernel_seconds(self) -> list[float]:
        """Device time of each kernel (profiling runs only); waits for the run to finish."""
        self.done.synchronize()
        return [a.elapsed_ms(b) / 1e3 for a, b in zip(self._events, self._events[1:], strict=False)]


def upload_model(runtime: Runtime, plan: KernelPlan, allocator: Allocator, stream: Stream) -> DeviceModel:
    """Copy every weight of `plan` to the device (the IO daemon replaces this direct path)."""
    weights = {
        name: upload_tensor(runtime, tensor, allocator.allocate, stream)
        for name, tensor in plan.load_weights().items()
    }
    views = {name: tensor.view(runtime) for name, tensor in weights.items()}
    return DeviceModel(plan, weights, views)


def free_model(model: DeviceModel, allocator: Allocator, stream: Stream) -> None:
    for tensor in model.weights.values():
        allocator.free(tensor.address, stream)
    model.weights.clear()
    model.weight_views.clear()


def _grid_blocks(var: VarSpec) -> int:
    return max(1, math.ceil(math.prod(var.shape) / ELEMENTS_PER_BLOCK))


class PlanExecutor:
    """Issues plans onto streams of one runtime, taking memory from an allocator."""

    def __init__(self, runtime: Runtime, allocator: Allocator, *, eager_recycling: bool = True) -> None:
        self.runtime = runtime
        self.allocator = allocator
        self.eager_recycling = eager_recycling

    def run(
        self,
        model: DeviceModel,
        inputs: Mapping[str, DeviceTensor],
        stream: Stream,
        *,
        cu_cap: int | None = None,
        profile: bool = False,
        on_kernel: Callable[[int, Kernel], None] | None = None,
    ) -> RunResult:
        """Issue every kernel of `model` on `stream`; returns at once with output handles.

        `inputs` maps the plan's input names to device tensors the caller owns. Outputs are allocated
        here and belong to the caller afterwards. `on_kernel(i, kernel)` is called as each kernel is
        issued (the memory pool follows a function's position in its plan through it).
        """
        plan = model.plan
        missing = [name for name in plan.inputs if name not in inputs]
        if missing:
            raise KeyError(f"model {plan.model}: missing inputs {missing}; the plan expects {plan.inputs}")
        started = time.perf_counter()
        stats = RunStats()
        handles: dict[str, DeviceTensor] = {**model.weights, **inputs}
        env: dict[str, torch.Tensor] = dict(model.weight_views)
        env.update((name, t.view(self.runtime)) for name, t in inputs.items())
        owned: dict[str, DeviceTensor] = {}  # allocated by this run: intermediates and outputs
        counts: dict[str, int] = {}
        live = 0
        events: list[Event] = []
        if profile:
            events.append(self._record(stream))
        try:
            for index, kernel in enumerate(plan.kernels):
                if on_kernel is not None:
                    on_kernel(index, kernel)
                for name in kernel.accesses:
                    if name not in handles:
                        var = plan.variables[name]
                        address = self.allocator.allocate(var.nbytes, stream)
                        handles[name] = owned[name] = DeviceTensor(
                            address, var.torch_dtype, tuple(var.shape), tuple(var.strides), var.nbytes
                        )
                        env[name] = handles[name].view(self.runtime)
                        live += var.nbytes
                        stats.allocations += 1
                stats.peak_live_bytes = max(stats.peak_live_bytes, live)
                if kernel.kind == "view":
                    env.update(invoke_kernel(kernel, env))  # metadata only: aliases, no device work
                else:
                    out = plan.variables[kernel.outputs[0]]
                    self.runtime.launch(
                        stream,
                        _bind(kernel, env),
                        blocks=_grid_blocks(out),
                        cu_cap=cu_cap,
                        name=kernel.name,
                    )
                    stats.kernels += 1
                    if profile:
                        events.append(self._record(stream))
                for name in kernel.accesses:
                    counts[name] = counts.get(name, 0) + 1
                    var = plan.variables[name]
                    if (
                        self.eager_recycling
                        and var.kind == "intermediate"
                        and counts[name] == var.expected_accesses
                    ):
                        self.allocator.free(owned.pop(name).address, stream)
                        live -= var.nbytes
        except BaseException:
            # A failed issue must not leak: hand back everything this run allocated (stream-ordered).
            for handle in owned.values():
                self.allocator.free(handle.address, stream)
            raise
        for name, handle in list(owned.items()):
            if plan.variables[name].kind == "intermediate":
                self.allocator.free(handle.address, stream)
                del owned[name]
        outputs = {name: owned.get(name) or handles[name] for name in plan.outputs}
        stats.issue_seconds = time.perf_counter() - started
        done = self._record(stream)
        return RunResult(outputs=outputs, stats=stats, done=done, _events=events)

    def _record(self, stream: Stream) -> Event:
        event = self.runtime.create_event()
        event.record(stream)
        return event


def _bind(kernel: Kernel, env: dict[str, torch.Tensor]) -> Callable[[], object]:
    # Variables are single-assignment: entries the kernel reads are final when it is issued, and
    # later issues only add entries, so the worker thread may read `env` itself.
    return lambda: invoke_kernel(kernel, env)
