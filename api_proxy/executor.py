"""Running a kernel plan on a stream of a device, through the mapping table.

The executor walks a plan in order. Every storage variable the run manages (intermediates and
outputs) is registered in a `MappingTable` (one per function instance) with the plan's expected
access count. For each kernel the executor asks the table for the addresses of the variables the
kernel touches -- the table allocates a variable at its first access (lazy allocation) and counts
one access per touch -- launches the kernel's call for those addresses on the stream, and hands the
buffers whose count is reached back to the allocator (eager recycling). Frees are stream-ordered, so
a buffer returns to the allocator only after the kernels issued before the free have run.

What a static plan decides once (ops, arguments, the rows each kernel touches, grids) is resolved
once per plan (`plan_program.PlanProgram`), so are the kernels at which each variable is allocated
and recycled (`PlanProgram.schedule`: `memory_pool.access_schedule`), and a kernel's call with its
tensors in place is bound once per instance and address set (`plan_program.KernelCalls`), so the hot
loop (`_issue_scheduled`) only makes one allocator call per kernel (`free_and_allocate`: what the
previous kernel spent, what this one touches first), launches and retires (docs/api_proxy.md, "The
plan executor"), the kernels launched a segment at a time where the pool can hold its fences
(`run_issue`). `_issue` counts per access instead, for the background recycler and for a plan
whose expected counts are too low (it raises `RecycledAccess` where the count is passed).

The pool mode decides the mechanisms (`PlanExecutor.for_mode`): `static` allocates every variable up
front and frees them at the end of the run; `fm` and `fm+rs` allocate lazily and recycle eagerly.
Recycling runs at the kernel boundary (default) or on a background thread calling `recycle()`
(the paper's recycler; measured against each other in `benchmarks/bench_memory_pool.py`).

Each issued kernel is written to a `PositionBoard` (kernel index, issue time, bytes held), which the
pool's resilient scaler reads. `on_kernel(i, kernel)` is called as each kernel is issued (before
it; earlier kernels may still wait in the run's segment: `run_issue.launch_pending`).

Device bytes come from an `Allocator`; the models the executor runs are `DeviceModel`s, resident
weights and all (both in `device_model`, re-exported here).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from functools import partial

from streambox.device import Event, Runtime, Stream
from streambox.kernel_compiler.plan import Kernel
from streambox.memory_pool.access_schedule import AccessSchedule, KernelStep
from streambox.memory_pool.mapping_table import HeldBuffer, MappingEntry, MappingTable, RecycledAccess
from streambox.memory_pool.modes import PoolMode
from streambox.memory_pool.scaler import PositionBoard

from .device_model import (
    Allocator,
    DeviceModel,
    StreamPoolAllocator,
    allocate_weights,
    copy_weights,
    free_all,
    free_model,
    release_generation,
    upload_model,
)
from .device_tensor import DeviceTensor
from .plan_program import ELEMENTS_PER_BLOCK, KernelCalls, PlanProgram, ProgramCache, RunInputs, plan_key
from .run_issue import IssueOne, IssueSegments, allocator_calls, holds_fences, launch_pending
from .run_result import RunResult, RunStats

__all__ = [
    "ELEMENTS_PER_BLOCK",
    "Allocator",
    "DeviceModel",
    "PlanExecutor",
    "RunResult",
    "RunStats",
    "StreamPoolAllocator",
    "allocate_weights",
    "copy_weights",
    "free_all",
    "free_model",
    "plan_key",
    "upload_model",
]

#: Where recycling runs: at the kernel boundary on the issuing thread, or on a background thread.
RECYCLERS = ("kernel", "thread")


@dataclass(frozen=True)
class _Ephemeral:
    """The instance id of a run called without one: registered for that run only."""

    n: int


class _Instance:
    """A function instance's mapping table, the stream its buffers are freed on, its kernels' bound calls."""

    __slots__ = ("table", "lock", "stream", "program", "ephemeral", "rows", "steps", "first", "last", "calls",
                 "reset", "placed")

    def __init__(self, eager_recycling: bool, ephemeral: bool) -> None:
        self.table = MappingTable(eager_recycling=eager_recycling)
        self.lock = threading.Lock()
        self.stream: Stream | None = None
        self.program: PlanProgram | None = None
        self.ephemeral = ephemeral
        # Per kernel of `program`: the table rows it touches, looked up once per registration.
        self.rows: list[tuple[MappingEntry, ...]] = []
        # Per kernel, its access schedule's step and the rows it allocates before the kernel and
        # recycles after it (None and empty when the plan runs through the table's counting path).
        self.steps: tuple[KernelStep, ...] | None = None
        self.first: list[tuple[MappingEntry, ...]] = []
        self.last: list[tuple[MappingEntry, ...]] = []
        # The calls bound by this instance's runs (the stream's worker binds and calls them).
        self.calls: KernelCalls | None = None
        # The table holds nothing and counts no access (its last run ended): the next run needs no reset.
        self.reset = False
        # Per kernel, the addresses its first accesses got last run, asked for again (the bound calls).
        self.placed: list[list[int]] = []


def _check_registered(state: _Instance, registered: PlanProgram | None, instance: Hashable) -> None:
    """A run still issuing stops once its instance was released (`release_instance`): its rows are gone."""
    if state.program is not registered:
        raise RecycledAccess(f"instance {instance!r} was released while its run was being issued")


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
        self._device_name = runtime.properties().name  # which preset's kernel times apply
        self.allocator = allocator
        self.eager_recycling = eager_recycling
        self.lazy = lazy
        self.recycler = recycler
        self.positions = positions
        self._free_batch, self._free_and_allocate = allocator_calls(allocator)
        self._segments = holds_fences(allocator)  # kernels launched a segment at a time (`run_issue`)
        self._generation = release_generation(allocator)
        self._instances: dict[Hashable, _Instance] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._programs = ProgramCache(self._device_name)

    @classmethod
    def for_mode(
        cls, runtime: Runtime, allocator: Allocator, mode: PoolMode | str, **options: object
    ) -> PlanExecutor:
        """The executor of a pool mode: `static` (up front, freed at the end), `fm`/`fm+rs` (lazy, eager)."""
        mode = PoolMode.parse(mode) if isinstance(mode, str) else mode
        return cls(runtime, allocator, eager_recycling=mode.eager_recycling, lazy=mode.lazy, **options)  # type: ignore[arg-type]

    # -- instances ------------------------------------------------------------------------------
    def _schedule(self, program: PlanProgram) -> AccessSchedule | None:
        """The plan's access schedule for this executor's mechanisms, or None: the table's counting
        path (the background recycler takes spent buffers from the table's queue; a plan whose
        expected counts are too low raises `RecycledAccess` where the count is passed)."""
        if self.eager_recycling and self.recycler != "kernel":
            return None
        return program.schedule(self.lazy, self.eager_recycling)

    def _program(self, model: DeviceModel) -> PlanProgram:
        """The model's program with its kernels' GPU times on this device (timed mode), once per plan:
        weights loaded again after their keep-alive are a new DeviceModel of the same plan."""
        if model._program is None:
            model._program = self._programs.get(model.plan)
        return model._program

    def _enter(
        self, instance: Hashable | None, program: PlanProgram, stream: Stream
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
                # A warm instance moved to another stream: what it still holds is freed on the old one,
                # and its calls are bound anew (the old stream's worker may still be calling them).
                self._free(state.table.reset_instance(instance), state.stream)
                state.calls = None
            state.stream = stream
            if state.program is None or state.program.key != program.key:
                leftovers = state.table.release_instance(instance)
                state.table.register_many(instance, program.key, program.managed)
                rows = state.table.rows(instance, program.key, [name for name, _, _ in program.managed])
                state.rows = [tuple(rows[r] for r in k.rows) for k in program.kernels]
                schedule = self._schedule(program)
                state.steps = schedule.steps if schedule is not None else None
                state.first = [tuple(rows[r] for r in step.first) for step in state.steps or ()]
                state.last = [tuple(rows[r] for r in step.last) for step in state.steps or ()]
                state.placed = [[] for _ in state.steps or ()]
                state.program = program
            else:
                leftovers = [] if state.reset else state.table.reset_instance(instance)
            state.reset = False
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
        with state.lock:  # a run still issuing sees `program` gone and stops (`_issue_scheduled`)
            held, stream, state.program = state.table.release_instance(instance), state.stream, None
        self._free(held, stream)
        return sum(h.nbytes for h in held)

    def instances(self) -> list[Hashable]:
        with self._lock:
            return list(self._instances)

    def held_bytes(self, instance: Hashable) -> int:
        """Bytes the instance's mapping table holds now (0 for an unknown instance)."""
        state = self._instances.get(instance)
        return state.table.held_bytes if state is not None else 0

    def calls_bound(self, instance: Hashable) -> int:
        """Kernel calls bound for `instance` since its model or the allocator's release generation last
        changed (after the run's `done`): a warm instance whose buffers come back at the same
        addresses binds none after its first run."""
        state = self._instances.get(instance)
        return state.calls.binds if state is not None and state.calls is not None else 0

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

    def _calls_for(self, state: _Instance, model: DeviceModel) -> KernelCalls:
        """The instance's bound calls if still valid for `model` and the allocator's generation."""
        generation = self._generation() if self._generation is not None else None
        calls = state.calls
        if calls is None or calls.model is not model or generation is None or calls.generation != generation:
            calls = KernelCalls(self.runtime, model.program, model.weight_views, model, generation)
            state.calls = calls
        return calls

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
        program = self._program(model)
        instance, state = self._enter(instance, program, stream)
        result = RunResult({}, RunStats(), None, instance, _plan_kernels=len(plan.kernels))  # type: ignore[arg-type]
        try:
            if profile:
                result._events.append(self._record(stream))
            issue = self._issue if state.steps is None else self._issue_scheduled
            allocations = state.table.allocations
            if not self.lazy:
                with state.lock:
                    state.table.materialize(instance, partial(self.allocator.allocate, stream=stream))
            with self.runtime.issuing(stream):
                peak = issue(instance, state, model, inputs, stream, cu_cap, on_kernel, result)
            result.stats.kernels = program.compute_kernels
            result.stats.peak_live_bytes = peak
            result.stats.allocations = state.table.allocations - allocations
            with state.lock:
                result.outputs.update(self._take_outputs(instance, state, program))
                leftovers = self._end_run(instance, state)
        except BaseException:
            # A failed issue must not leak: hand back everything this run holds (stream-ordered).
            with state.lock:
                held = self._end_run(instance, state)
            self._finish(instance, state, held, stream)
            raise
        for name in plan.outputs:  # outputs that are no buffer of this run: an input or a weight
            if name not in result.outputs:
                result.outputs[name] = inputs[name] if name in inputs else model.weights[name]
        result.done = self._finish(instance, state, leftovers, stream)
        result.stats.issue_seconds = time.perf_counter() - started
        return result

    def _issue(
        self,
        instance: Hashable,
        state: _Instance,
        model: DeviceModel,
        inputs: Mapping[str, DeviceTensor],
        stream: Stream,
        cu_cap: int | None,
        on_kernel: Callable[[int, Kernel], None] | None,
        result: RunResult,
    ) -> int:
        """The hot loop: per kernel, count its accesses (the table allocates at the first and queues
        the buffer at the last), launch its call for those addresses, free what it spent. Everything
        else was decided once per plan (`PlanProgram`) or per instance (`_Instance.rows`)."""
        program, table, lock, rows = model.program, state.table, state.lock, state.rows
        with lock:
            calls = self._calls_for(state, model)
        run_inputs = RunInputs(inputs)
        events, timed = result._events, result._timed
        alloc = partial(self.allocator.allocate, stream=stream)
        free_batch, launch = self._free_batch, self.runtime.launch
        recycle_here = self.eager_recycling and self.recycler == "kernel"
        # Recycling here (or not at all): the table hands each kernel's spent addresses straight back
        # (`spent`) and says what the kernel held; the background recycler takes them from its queue.
        if recycle_here or not self.eager_recycling:
            touch, live = table.touch_recycling, (lambda: table.touched_bytes)
        else:
            touch, live = (lambda entries, alloc, _: table.touch(entries, alloc)), (lambda: table.held_bytes)
        board, generation, name, batch = self.positions, self._generation, model.plan.model, model.plan.batch
        input_address = {n: t.address for n, t in inputs.items()}
        profile, peak = bool(events), 0
        for k in program.kernels:
            if board is not None:
                board.update(instance, name, batch, k.index, time.perf_counter(), table.held_bytes)
            if on_kernel is not None:
                on_kernel(k.index, k.kernel)
            spent: list[int] = []
            with lock:  # access -> launch is atomic for the background recycler
                addresses = touch(rows[k.index], alloc, spent)
                peak = max(peak, live())
                if k.compute:
                    if k.inputs:
                        addresses.extend(input_address[n] for n in k.inputs)
                    if generation is not None and generation() != calls.generation:
                        calls = self._calls_for(state, model)  # the pool gave memory back meanwhile
                    launch(stream, partial(calls.call, run_inputs, k.index, addresses),
                           blocks=k.blocks, cu_cap=cu_cap, name=k.kernel.name, duration_s=k.duration_s)
                    if profile:
                        events.append(self._record(stream))
                        timed.append(k.index)
            if spent:
                free_batch(spent, stream)
        return peak

    def _issue_scheduled(
        self,
        instance: Hashable,
        state: _Instance,
        model: DeviceModel,
        inputs: Mapping[str, DeviceTensor],
        stream: Stream,
        cu_cap: int | None,
        on_kernel: Callable[[int, Kernel], None] | None,
        result: RunResult,
    ) -> int:
        """The hot loop on the plan's `AccessSchedule`: one allocator call per kernel (module doc),
        carried out by `run_issue` (a segment at a time, or one by one under a profile)."""
        program, table, lock, rows = model.program, state.table, state.lock, state.rows
        steps, first, last, registered = state.steps, state.first, state.last, state.program  # from `_enter`
        assert steps is not None  # `run` chose this path by it
        placed = state.placed
        with lock:
            calls = self._calls_for(state, model)
        run_inputs = RunInputs(inputs)
        board, generation, name, batch = self.positions, self._generation, model.plan.model, model.plan.batch
        input_address = {n: t.address for n, t in inputs.items()}
        peak = table.held_bytes
        spent: list[int] = []  # recycled by the last kernel, freed with the next kernel's allocations
        issue = self._run_issue(stream, result, on_kernel)
        allocate, launch = issue.allocate, issue.launch
        try:
            for k in program.kernels:
                i, step = k.index, steps[k.index]
                if board is not None:
                    board.update(instance, name, batch, i, time.perf_counter(), table.held_bytes)
                if on_kernel is not None:
                    on_kernel(i, k.kernel)
                with lock:  # against `release_instance` from another thread
                    if state.program is not registered:
                        _check_registered(state, registered, instance)  # raises
                    if step.first or spent:
                        freeing, spent = spent, []
                        placed[i] = got = allocate(freeing, step.sizes, placed[i])
                        peak = max(peak, table.place(first[i], got))
                    if k.compute:
                        addresses = [entry.address for entry in rows[i]]
                        if k.inputs:
                            addresses.extend(input_address[n] for n in k.inputs)
                        if generation is not None and generation() != calls.generation:
                            calls = self._calls_for(state, model)  # the pool gave memory back meanwhile
                        call = partial(calls.call, run_inputs, i, addresses)
                        launch(i, (call, k.blocks, cu_cap, k.kernel.name, k.duration_s))
                    if step.last:
                        table.retire(last[i], spent)
            issue.finish()
        finally:
            try:
                if spent:
                    self._free_batch(spent, stream)
            finally:
                issue.close()
        return peak

    def _run_issue(
        self, stream: Stream, result: RunResult, on_kernel: Callable[[int, Kernel], None] | None
    ) -> IssueOne | IssueSegments:
        """How this run's kernels reach the device (`run_issue`)."""
        launch_pending()  # a run issued from another's hook on this thread: that one's kernels first
        profile = (result._events, result._timed, self._record) if result._events else None
        if self._segments and profile is None:
            return IssueSegments(self.runtime, stream, self.allocator, self._free_and_allocate)
        return IssueOne(self.runtime, stream, self._free_and_allocate, profile)

    @staticmethod
    def _take_outputs(instance: Hashable, state: _Instance, program: PlanProgram) -> dict[str, DeviceTensor]:
        """The run's managed outputs, detached from the table: the caller owns them now."""
        outputs = {}
        for name in program.outputs:
            held = state.table.detach(instance, program.key, name)
            if held is not None:
                spec = program.specs[name]
                outputs[name] = DeviceTensor(
                    held.address, program.dtypes[name], tuple(spec.shape), tuple(spec.strides), spec.nbytes
                )
        return outputs

    @staticmethod
    def _end_run(instance: Hashable, state: _Instance) -> list[HeldBuffer]:
        """Everything the run still holds; an ephemeral instance forgets its registrations too."""
        if state.ephemeral:
            return state.table.release_instance(instance)
        held = state.table.reset_instance(instance)
        state.reset = True
        return held

    def _finish(self, instance: Hashable, state: _Instance, held: list[HeldBuffer], stream: Stream) -> Event:
        if held:
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
