"""Running a kernel plan on a stream of a device, through the mapping table.

The executor walks a plan in order. Every storage variable the run manages (intermediates and
outputs) is registered in a `MappingTable` (one per function instance) with the plan's expected
access count. For each kernel the executor asks the table for the addresses of the variables the
kernel touches -- the table allocates a variable at its first access (lazy allocation) and counts
one access per touch -- builds tensor views, launches the kernel on the stream, and hands the
buffers whose count is reached back to the allocator (eager recycling). Frees are stream-ordered, so
a buffer returns to the allocator only after the kernels issued before the free have run.

The pool mode decides the mechanisms (`PlanExecutor.for_mode`): `static` allocates every variable up
front and frees them at the end of the run; `fm` and `fm+rs` allocate lazily and recycle eagerly.
Recycling runs at the kernel boundary (default) or on a background thread calling `recycle()`
(the paper's recycler; measured against each other in `benchmarks/bench_memory_pool.py`).

Each issued kernel is written to a `PositionBoard` (kernel index, issue time, bytes held), which the
pool's resilient scaler reads. `on_kernel(i, kernel)` is called as each kernel is issued.

Device bytes come from an `Allocator`: `memory_pool.DeviceMemoryPool` (the runtime's pool, which
every byte of a proxy comes from) or `StreamPoolAllocator` (the device's own stream-ordered pool).
Weights are allocated (`allocate_weights`) and copied (`copy_weights`) in separate steps, so that the
IO daemon can replace the copies; `upload_model` does both.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from streambox.device import Event, MemoryPool, Runtime, Stream
from streambox.kernel_compiler.cost_model import launch_durations
from streambox.kernel_compiler.ops import invoke_kernel
from streambox.kernel_compiler.plan import Kernel, KernelPlan, VarSpec
from streambox.memory_pool.mapping_table import HeldBuffer, MappingTable
from streambox.memory_pool.modes import PoolMode
from streambox.memory_pool.scaler import PositionBoard

from .device_tensor import DeviceTensor

#: Threads per block times elements per thread of a typical elementwise kernel: the emulated grid size.
ELEMENTS_PER_BLOCK = 1024

#: Where recycling runs: at the kernel boundary on the issuing thread, or on a background thread.
RECYCLERS = ("kernel", "thread")

MANAGED_KINDS = ("intermediate", "output")


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


def free_all(allocator: Allocator, addresses: Iterable[int], stream: Stream, *, fence: bool = False) -> None:
    """Free addresses stream-ordered, in one batch when the allocator takes batches (`free_many`).

    `fence=True`: no more frees follow on this stream soon, so ask the allocator (if it batches
    fences, as `DeviceMemoryPool` does) to make them free for every stream once the stream gets here.
    """
    free_many = getattr(allocator, "free_many", None)
    if free_many is not None:
        free_many(addresses, stream)
    else:
        for address in addresses:
            allocator.free(address, stream)
    fence_fn = getattr(allocator, "fence", None) if fence else None
    if fence_fn is not None:
        fence_fn(stream)


def plan_key(plan: KernelPlan) -> str:
    """`model/b<batch>/<input shape>`: one plan of a model."""
    return f"{plan.model}/b{plan.batch}/{'x'.join(str(d) for d in plan.input_shape)}"


@dataclass(frozen=True)
class PlanLayout:
    """What the executor needs of a plan, computed once: the managed variables (name, bytes,
    expected accesses; None = never recycled by count, i.e. outputs) and, per kernel, the managed
    variables it touches."""

    key: str
    managed: tuple[tuple[str, int, int | None], ...]
    accesses: tuple[tuple[str, ...], ...]
    outputs: tuple[str, ...]

    @classmethod
    def of(cls, plan: KernelPlan) -> PlanLayout:
        variables = plan.variables
        managed = tuple(
            (v.name, v.nbytes, (v.expected_accesses or None) if v.kind == "intermediate" else None)
            for v in variables.values()
            if v.kind in MANAGED_KINDS
        )
        names = {name for name, _, _ in managed}
        return cls(
            key=plan_key(plan),
            managed=managed,
            accesses=tuple(tuple(n for n in k.accesses if n in names) for k in plan.kernels),
            outputs=tuple(n for n in plan.outputs if n in names),
        )


@dataclass
class DeviceModel:
    """A plan whose weights are resident on one device."""

    plan: KernelPlan
    weights: dict[str, DeviceTensor]
    # Tensor views over the resident weights, built once: a run only makes views of what it allocates.
    weight_views: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _layout: PlanLayout | None = field(default=None, repr=False)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights.values())

    @property
    def layout(self) -> PlanLayout:
        if self._layout is None:
            self._layout = PlanLayout.of(self.plan)
        return self._layout


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
    instance: Hashable = None
    _events: list[Event] = field(default_factory=list, repr=False)
    _timed: list[int] = field(default_factory=list, repr=False)  # plan index of each timed kernel
    _plan_kernels: int = 0

    def kernel_seconds(self) -> list[float]:
        """Device time of each compute kernel (profiling runs only); waits for the run to finish."""
        self.done.synchronize()
        return [a.elapsed_ms(b) / 1e3 for a, b in zip(self._events, self._events[1:], strict=False)]

    def plan_kernel_seconds(self) -> list[float]:
        """Device time of every kernel of the plan, 0.0 for view kernels (profiling runs only)."""
        seconds = [0.0] * self._plan_kernels
        for index, s in zip(self._timed, self.kernel_seconds(), strict=True):
            seconds[index] = s
        return seconds


def allocate_weights(runtime: Runtime, plan: KernelPlan, allocator: Allocator, stream: Stream) -> DeviceModel:
    """Device memory for every weight of `plan` (no copy yet: see `copy_weights`)."""
    weights: dict[str, DeviceTensor] = {}
    try:
        for var in plan.vars_of_kind("weight"):
            address = allocator.allocate(var.nbytes, stream)
            weights[var.name] = DeviceTensor(
                address, var.torch_dtype, tuple(var.shape), _contiguous_strides(var.shape), var.nbytes
            )
    except BaseException:  # e.g. out of memory half-way: nothing half-loaded stays
        free_all(allocator, [t.address for t in weights.values()], stream, fence=True)
        raise
    views = {name: tensor.view(runtime) for name, tensor in weights.items()}
    return DeviceModel(plan, weights, views)


def copy_weights(
    runtime: Runtime, model: DeviceModel, stream: Stream, tensors: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Copy the weights into their device memory on `stream` (the IO daemon replaces this direct path)."""
    tensors = model.plan.load_weights() if tensors is None else tensors
    for name, handle in model.weights.items():
        host = tensors[name].detach().contiguous()
        if host.numel() * host.element_size() != handle.nbytes:
            raise ValueError(
                f"weight {name}: {host.numel() * host.element_size()} bytes, expected {handle.nbytes}"
            )
        runtime.copy_htod_async(handle.address, host.view(-1).view(torch.uint8), handle.nbytes, stream)


def upload_model(runtime: Runtime, plan: KernelPlan, allocator: Allocator, stream: Stream) -> DeviceModel:
    """Allocate and copy every weight of `plan` (`allocate_weights` then `copy_weights`)."""
    model = allocate_weights(runtime, plan, allocator, stream)
    try:
        copy_weights(runtime, model, stream)
    except BaseException:
        free_model(model, allocator, stream)
        raise
    return model


def free_model(model: DeviceModel, allocator: Allocator, stream: Stream) -> None:
    free_all(allocator, [t.address for t in model.weights.values()], stream, fence=True)
    model.weights.clear()
    model.weight_views.clear()


def _contiguous_strides(shape: Iterable[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(list(shape)):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _grid_blocks(var: VarSpec) -> int:
    return max(1, math.ceil(math.prod(var.shape) / ELEMENTS_PER_BLOCK))


@dataclass(frozen=True)
class _Ephemeral:
    """The instance id of a run called without one: registered for that run only."""

    n: int


class _Instance:
    """A function instance's mapping table and the stream its buffers are freed on."""

    __slots__ = ("table", "lock", "stream", "layout", "ephemeral", "views")

    def __init__(self, eager_recycling: bool, ephemeral: bool) -> None:
        self.table = MappingTable(eager_recycling=eager_recycling)
        self.lock = threading.Lock()
        self.stream: Stream | None = None
        self.layout: PlanLayout | None = None
        self.ephemeral = ephemeral
        # Views the stream's worker made, by (address, dtype, shape, strides): a warm instance gets the
        # same addresses run after run (same-stream reuse), so most views are made once. Only the
        # worker touches it; a hit means the address is allocated to this run now, so the view is valid.
        self.views: dict[tuple, torch.Tensor] = {}


class PlanExecutor:
    """Issues plans onto streams of one runtime, taking memory from an allocator.

    Thread-safe across instances (one function instance runs one plan at a time).
    """

    def __init__(
        self,
        runtime: Runtime,
        allocator: Allocator,
        *,
        eager_recycling: bool = True,
        lazy: bool = True,
        recycler: str = "kernel",
        positions: PositionBoard | None = None,
    ) -> None:
        if recycler not in RECYCLERS:
            raise ValueError(f"unknown recycler {recycler!r}; choose one of {RECYCLERS}")
        self.runtime = runtime
        self.allocator = allocator
        self.eager_recycling = eager_recycling
        self.lazy = lazy
        self.recycler = recycler
        self.positions = positions
        free_many = getattr(allocator, "free_many", None)
        self._free_batch: Callable[[list[int], Stream], None] = free_many or (
            lambda addresses, stream: free_all(allocator, addresses, stream)
        )
        self._instances: dict[Hashable, _Instance] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()

    @classmethod
    def for_mode(
        cls, runtime: Runtime, allocator: Allocator, mode: PoolMode | str, **options: object
    ) -> PlanExecutor:
        """The executor of a pool mode: `static` (up front, freed at the end), `fm`/`fm+rs` (lazy, eager)."""
        mode = PoolMode.parse(mode) if isinstance(mode, str) else mode
        return cls(runtime, allocator, eager_recycling=mode.eager_recycling, lazy=mode.lazy, **options)  # type: ignore[arg-type]

    # -- instances ------------------------------------------------------------------------------
    def _enter(
        self, instance: Hashable | None, layout: PlanLayout, stream: Stream
    ) -> tuple[Hashable, _Instance]:
        with self._lock:
            if instance is None:
                instance = _Ephemeral(next(self._ids))
                state = self._instances[instance] = _Instance(self.eager_recycling, ephemeral=True)
            else:
                state = self._instances.get(instance)
                if state is None:
                    state = self._instances[instance] = _Instance(self.eager_recycling, ephemeral=False)
        with state.lock:
            if state.stream is not None and state.stream is not stream:
                # A warm instance moved to another stream: what it still holds is freed on the old one.
                self._free(state.table.reset_instance(instance), state.stream)
            state.stream = stream
            if state.layout is None or state.layout.key != layout.key:
                leftovers = state.table.release_instance(instance)
                state.table.register_many(instance, layout.key, layout.managed)
                state.layout = layout
            else:
                leftovers = state.table.reset_instance(instance)
        self._free(leftovers, stream)
        return instance, state

    def release_instance(self, instance: Hashable) -> int:
        """Forget a finished, crashed or abandoned instance; frees everything it still holds (on its
        stream, stream-ordered) and returns the bytes. Unknown instances return 0."""
        with self._lock:
            state = self._instances.pop(instance, None)
        if self.positions is not None:
            self.positions.remove(instance)
        if state is None:
            return 0
        with state.lock:
            held = state.table.release_instance(instance)
            stream = state.stream
        self._free(held, stream)
        return sum(h.nbytes for h in held)

    def instances(self) -> list[Hashable]:
        with self._lock:
            return list(self._instances)

    def held_bytes(self, instance: Hashable) -> int:
        """Bytes the instance's mapping table holds now (0 for an unknown instance)."""
        state = self._instances.get(instance)
        return state.table.held_bytes if state is not None else 0

    def recycle(self) -> int:
        """The background recycler's sweep: hand every instance's spent buffers back; returns bytes."""
        with self._lock:
            states = list(self._instances.items())
        total = 0
        for _, state in states:
            with state.lock:
                spent = state.table.reclaim()
                stream = state.stream
            if spent:
                self._free(spent, stream)
                total += sum(h.nbytes for h in spent)
        return total

    def _free(self, held: list[HeldBuffer], stream: Stream | None) -> None:
        if held:
            if stream is None:
                raise RuntimeError("buffers held by an instance that never ran on a stream")
            free_all(self.allocator, [h.address for h in held], stream, fence=True)

    # -- running --------------------------------------------------------------------------------
    def run(
        self,
        model: DeviceModel,
        inputs: Mapping[str, DeviceTensor],
        stream: Stream,
        *,
        instance: Hashable | None = None,
        cu_cap: int | None = None,
        profile: bool = False,
        on_kernel: Callable[[int, Kernel], None] | None = None,
    ) -> RunResult:
        """Issue every kernel of `model` on `stream` for function `instance`; returns at once.

        `inputs` maps the plan's input names to device tensors the caller owns. Outputs are allocated
        here and belong to the caller afterwards (free them through the allocator). A warm instance
        keeps its registrations between runs; `instance=None` registers for this run only.
        """
        plan = model.plan
        missing = [name for name in plan.inputs if name not in inputs]
        if missing:
            raise KeyError(f"model {plan.model}: missing inputs {missing}; the plan expects {plan.inputs}")
        started = time.perf_counter()
        layout = model.layout
        instance, state = self._enter(instance, layout, stream)
        table, lock, key = state.table, state.lock, layout.key
        runtime = self.runtime
        variables = plan.variables
        allocate = self.allocator.allocate
        kernel_recycling = self.eager_recycling and self.recycler == "kernel"
        free_batch = self._free_batch
        views = state.views
        view_limit = 2 * len(layout.managed) + 64
        board = self.positions
        stats = RunStats()
        durations = launch_durations(plan, runtime.properties().name)  # computed once per plan
        env: dict[str, torch.Tensor] = dict(model.weight_views)
        env.update((name, t.view(runtime)) for name, t in inputs.items())
        handles: dict[str, DeviceTensor] = {}  # allocated by this run
        # Views over new buffers and view kernels (metadata only) are made by the stream's worker
        # right before the next compute kernel: the issuing thread stays light (see `_kernel_call`).
        prelude: list[tuple[str, DeviceTensor] | Kernel] = []
        events: list[Event] = []
        timed: list[int] = []

        def alloc(nbytes: int) -> int:
            return allocate(nbytes, stream)

        def bind(name: str, address: int) -> None:
            var = variables[name]
            handle = DeviceTensor(address, var.torch_dtype, tuple(var.shape), tuple(var.strides), var.nbytes)
            handles[name] = handle
            prelude.append((name, handle))
            stats.allocations += 1

        if profile:
            events.append(self._record(stream))
        try:
            if not self.lazy:
                with lock:
                    table.materialize(instance, alloc)
                    for entry in table.entries(instance):
                        if entry.address is not None:
                            bind(entry.var, entry.address)
            for index, kernel in enumerate(plan.kernels):
                if board is not None:
                    board.update(
                        instance, plan.model, plan.batch, index, time.perf_counter(), table.held_bytes
                    )
                if on_kernel is not None:
                    on_kernel(index, kernel)
                spent: list[HeldBuffer] = []
                with lock:  # access -> launch is atomic for the background recycler
                    for name in layout.accesses[index]:
                        address = table.access(instance, key, name, alloc)
                        if name not in handles:
                            bind(name, address)
                    if table.held_bytes > stats.peak_live_bytes:
                        stats.peak_live_bytes = table.held_bytes
                    if kernel.kind == "view":
                        prelude.append(kernel)
                    else:
                        work = _kernel_call(runtime, kernel, env, prelude, views, view_limit)
                        prelude = []
                        blocks = _grid_blocks(variables[kernel.outputs[0]])
                        runtime.launch(
                            stream, work, blocks=blocks, cu_cap=cu_cap, name=kernel.name,
                            duration_s=durations[index],
                        )
                        stats.kernels += 1
                        if profile:
                            events.append(self._record(stream))
                            timed.append(index)
                    if kernel_recycling:
                        spent = table.reclaim()
                if spent:
                    free_batch([h.address for h in spent], stream)
            with lock:
                outputs = {}
                for name in layout.outputs:
                    if table.detach(instance, key, name) is not None:
                        outputs[name] = handles[name]
                if state.ephemeral:
                    leftovers = table.release_instance(instance)
                else:
                    leftovers = table.reset_instance(instance)
        except BaseException:
            # A failed issue must not leak: hand back everything this run holds (stream-ordered).
            with lock:
                held = table.release_instance(instance) if state.ephemeral else table.reset_instance(instance)
            self._finish(instance, state, held, stream)
            raise
        for name in plan.outputs:  # outputs that are no buffer of this run: an input or a weight
            if name not in outputs:
                outputs[name] = inputs[name] if name in inputs else model.weights[name]
        done = self._finish(instance, state, leftovers, stream)
        stats.issue_seconds = time.perf_counter() - started
        return RunResult(outputs, stats, done, instance, events, timed, len(plan.kernels))

    def _finish(self, instance: Hashable, state: _Instance, held: list[HeldBuffer], stream: Stream) -> Event:
        free_all(self.allocator, [h.address for h in held], stream)
        done = self._record(stream)
        fence = getattr(self.allocator, "fence", None)
        if fence is not None:
            fence(stream, done)  # the run's last frees become free for every stream after `done`
        if self.positions is not None:
            self.positions.remove(instance)
        if state.ephemeral:
            with self._lock:
                self._instances.pop(instance, None)
        return done

    def _record(self, stream: Stream) -> Event:
        event = self.runtime.create_event()
        event.record(stream)
        return event


def _kernel_call(
    runtime: Runtime,
    kernel: Kernel,
    env: dict[str, torch.Tensor],
    prelude: list[tuple[str, DeviceTensor] | Kernel],
    views: dict[tuple, torch.Tensor],
    view_limit: int,
) -> Callable[[], object]:
    """The work of one compute kernel on the stream's worker: first the views over buffers allocated
    since the previous compute kernel and the view kernels issued meanwhile (in issue order), then
    the kernel. Making views on the worker keeps the issuing thread short (a view costs tens of
    microseconds and, on the emulated device, waits for the GIL the worker holds), and a view of a
    buffer freed too early fails there, as a use after free. Views already made for the same address
    and layout (the instance's `views`, bounded by `view_limit`) are reused. Only the worker touches
    `env` and `views` after the run starts; variables are single-assignment, so the order of the
    stream is all it needs."""

    def run() -> object:
        for item in prelude:
            if isinstance(item, Kernel):
                env.update(invoke_kernel(item, env))  # metadata only: aliases, no device work
            else:
                name, handle = item
                key = (handle.address, handle.dtype, handle.shape, handle.strides)
                view = views.get(key)
                if view is None:
                    if len(views) >= view_limit:
                        views.clear()
                    view = views[key] = handle.view(runtime)
                env[name] = view
        return invoke_kernel(kernel, env)

    return run
