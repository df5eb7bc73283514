"""What the executor decides once per plan, and the kernel calls it binds once per instance.

A kernel plan is static: for one (model, batch, input shape) its kernels, their ops and arguments, the
storage variables each kernel touches and the grid it launches are fixed. `PlanProgram.of(plan)`
resolves all of that once, so the executor's hot loop does only what changes from run to run: count
the accesses (allocating at the first, recycling at the last), launch, free.

`KernelCalls` turns a compute kernel into a ready call (op and arguments, tensors in place) for the
addresses its storage variables have in this run. A warm instance gets the same addresses run after
run (the pool hands a stream its own frees back first), so a call bound once is called again as it
is: no view made, no argument resolved. A call is reused only for the very addresses it was bound to,
and only while the allocator has given no memory back to the device (its release generation), so a
tensor over a released and re-reserved chunk is never reused.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from streambox.device import Runtime
from streambox.kernel_compiler.argcodec import var_names
from streambox.kernel_compiler.cost_model import launch_durations
from streambox.kernel_compiler.ops import bind_kernel, invoke_kernel
from streambox.kernel_compiler.plan import Kernel, KernelPlan, VarSpec
from streambox.memory_pool.access_schedule import AccessSchedule

from .device_tensor import DeviceTensor

#: Threads per block times elements per thread of a typical elementwise kernel: the emulated grid size.
ELEMENTS_PER_BLOCK = 1024

#: Bound calls kept per kernel: a warm instance's buffers come back at one of a few address sets.
CALLS_PER_KERNEL = 2

#: Plans whose programs an executor keeps (a proxy serves a few models and input shapes).
PROGRAMS_KEPT = 64

#: The variables a run allocates and recycles (inputs belong to the caller, weights to the model).
MANAGED_KINDS = ("intermediate", "output")


def plan_key(plan: KernelPlan) -> str:
    """`model/b<batch>/<input shape>`: one plan of a model."""
    return f"{plan.model}/b{plan.batch}/{'x'.join(str(d) for d in plan.input_shape)}"


def grid_blocks(var: VarSpec) -> int:
    """The grid of a kernel writing `var`: one block per `ELEMENTS_PER_BLOCK` elements."""
    return max(1, math.ceil(math.prod(var.shape) / ELEMENTS_PER_BLOCK))


class ProgramKernel(NamedTuple):
    """One kernel of a plan, with what the hot loop needs of it decided."""

    index: int  # position in the plan
    kernel: Kernel
    rows: tuple[int, ...]  # managed variables it touches (indices into `PlanProgram.managed`), in order
    compute: bool  # False: a view kernel, which counts its accesses and launches nothing
    blocks: int  # grid size
    inputs: tuple[str, ...]  # plan inputs it reads (directly or through views): part of its signature
    refs: tuple[str, ...]  # every variable its arguments and outputs name (what binding resolves)
    # Modelled GPU seconds of the kernel (for `Runtime.launch(duration_s=...)` in timed mode); None
    # until a cost model fills it (`PlanProgram.of(plan, durations)`).
    duration_s: float | None = None


@dataclass(frozen=True)
class PlanProgram:
    """A plan resolved for the executor: computed once per plan, shared by every instance and run."""

    key: str
    managed: tuple[tuple[str, int, int | None], ...]  # (name, bytes, expected accesses; None: never by count)
    kernels: tuple[ProgramKernel, ...]
    outputs: tuple[str, ...]  # managed outputs, handed to the caller after the run
    specs: Mapping[str, VarSpec]
    dtypes: Mapping[str, torch.dtype]
    producers: Mapping[str, Kernel]  # view variable -> the view kernel that makes it
    compute_kernels: int
    # (lazy, eager) -> the plan's access schedule (None: its counts raise, see `access_schedule`).
    _schedules: dict[tuple[bool, bool], AccessSchedule | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def of(cls, plan: KernelPlan, durations: Sequence[float] | None = None) -> PlanProgram:
        """`durations`: per-kernel modelled seconds (e.g. `plan.kernel_seconds(preset)`), or None."""
        specs = plan.variables
        if durations is not None and len(durations) != len(plan.kernels):
            raise ValueError(f"{len(durations)} durations for {len(plan.kernels)} kernels ({plan.model})")
        managed = tuple(
            (v.name, v.nbytes, (v.expected_accesses or None) if v.kind == "intermediate" else None)
            for v in specs.values()
            if v.kind in MANAGED_KINDS
        )
        row_of = {name: row for row, (name, _, _) in enumerate(managed)}
        inputs = set(plan.inputs)
        kernels = []
        for index, kernel in enumerate(plan.kernels):
            compute = kernel.kind != "view"
            refs = [*var_names(kernel.args), *var_names(list(kernel.kwargs.values())), *kernel.outputs]
            kernels.append(
                ProgramKernel(
                    index=index,
                    kernel=kernel,
                    rows=tuple(row_of[n] for n in kernel.accesses if n in row_of),
                    compute=compute,
                    blocks=grid_blocks(specs[kernel.outputs[0]]) if compute else 0,
                    inputs=tuple(n for n in kernel.accesses if n in inputs) if compute else (),
                    refs=tuple(dict.fromkeys(refs)),
                    duration_s=None if durations is None else float(durations[index]),
                )
            )
        return cls(
            key=plan_key(plan),
            managed=managed,
            kernels=tuple(kernels),
            outputs=tuple(n for n in plan.outputs if n in row_of),
            specs=specs,
            dtypes={name: v.torch_dtype for name, v in specs.items()},
            producers={out: k for k in plan.kernels if k.kind == "view" for out in k.outputs},
            compute_kernels=sum(k.compute for k in kernels),
        )

    def schedule(self, lazy: bool, eager: bool) -> AccessSchedule | None:
        """When each managed variable is allocated and recycled under a pool mode's mechanisms,
        decided once per plan and mode (None when the plan's expected counts are too low)."""
        key = (lazy, eager)
        if key not in self._schedules:
            self._schedules[key] = AccessSchedule.of(
                [nbytes for _, nbytes, _ in self.managed],
                [expected for _, _, expected in self.managed],
                [k.rows for k in self.kernels],
                lazy=lazy,
                eager=eager,
            )
        return self._schedules[key]

    def rows_of(self, kernel: ProgramKernel) -> tuple[str, ...]:
        return tuple(self.managed[row][0] for row in kernel.rows)


class RunInputs(NamedTuple):
    """What one run gives its kernels' binding: the caller's input tensors (handles; a view is made
    only when a call reading the input is bound, so a warm run makes none)."""

    handles: Mapping[str, DeviceTensor]


class KernelCalls:
    """The bound calls of one instance's runs of one device model, while the allocator's release
    generation stays `generation`. With an allocator that keeps no generation (None) the executor
    makes one per run: within a run a variable keeps its address, so its tensor is made once.

    Only the stream's worker calls `call` (the emulated device; the CUDA backend calls it on the
    issuing thread at launch), in stream order, so no lock is needed: variables are single-assignment
    and a call is bound before it runs.
    """

    def __init__(
        self,
        runtime: Runtime,
        program: PlanProgram,
        weights: Mapping[str, torch.Tensor],
        model: Hashable,
        generation: Hashable | None,
    ) -> None:
        self.runtime = runtime
        self.program = program
        self.weights = weights
        self.model = model  # the DeviceModel the calls were bound for (weights live as long as it does)
        self.generation = generation
        # Per kernel, its calls for the last `CALLS_PER_KERNEL` address lists, most recent first.
        self._calls: list[list[tuple[list[int], Callable[[], object]]]] = [[] for _ in program.kernels]
        # (variable, address of its storage) -> tensor; bounded by `_tensor_limit`.
        self._tensors: dict[tuple[str, int | None], torch.Tensor] = {}
        self._tensor_limit = 4 * len(program.specs) + 64
        self.binds = 0  # calls bound so far (a warm instance binds few)

    def call(self, run: RunInputs, index: int, addresses: list[int]) -> object:
        """Run kernel `index` for the storage addresses `addresses` (its rows', then its inputs')."""
        calls = self._calls[index]
        for bound_to, bound in calls:
            if bound_to == addresses:
                return bound()
        bound = self._bind(run, self.program.kernels[index], addresses)
        calls.insert(0, (addresses, bound))
        del calls[CALLS_PER_KERNEL:]
        return bound()

    def _bind(self, run: RunInputs, pk: ProgramKernel, addresses: list[int]) -> Callable[[], object]:
        self.binds += 1
        address_of = dict(zip((*self.program.rows_of(pk), *pk.inputs), addresses, strict=True))
        env = {name: self._tensor(name, address_of, run) for name in pk.refs}
        return bind_kernel(pk.kernel, env)

    def _tensor(self, name: str, address_of: dict[str, int], run: RunInputs) -> torch.Tensor:
        spec = self.program.specs[name]
        if spec.kind == "weight":
            return self.weights[name]
        address = address_of.get(spec.base if spec.base is not None else name)  # None: a weight's view
        tensor = self._tensors.get((name, address))
        if tensor is not None:
            return tensor
        if len(self._tensors) >= self._tensor_limit:
            self._tensors.clear()
        if spec.kind == "input":  # the caller's layout, which need not be the plan's
            tensor = self._tensors[(name, address)] = run.handles[name].view(self.runtime)
            return tensor
        if spec.base is None:  # a managed storage variable: a view over its device bytes
            dtype, shape, strides = self.program.dtypes[name], tuple(spec.shape), tuple(spec.strides)
            tensor = self._tensors[(name, address)] = self.runtime.view(address, dtype, shape, strides)
            return tensor
        # A view variable: run its view kernel (metadata only) over its arguments' tensors.
        producer = self.program.producers[name]
        names = [*var_names(producer.args), *var_names(list(producer.kwargs.values()))]
        env = {n: self._tensor(n, address_of, run) for n in names}
        for out, view in invoke_kernel(producer, env).items():
            self._tensors[(out, address)] = view
        return self._tensors[(name, address)]


class ProgramCache:
    """Each plan's program with its kernels' GPU times on one device, made once per plan object and
    kept for the `PROGRAMS_KEPT` plans used last. Weights freed after their keep-alive and loaded
    again are a new `DeviceModel` of the same plan: its program is not made again. An entry holds its
    plan, so the plan's id is not reused while it is cached. Thread-safe."""

    def __init__(self, device_name: str, limit: int = PROGRAMS_KEPT) -> None:
        self.device_name = device_name  # which preset's kernel times apply
        self.limit = limit
        self._programs: OrderedDict[int, tuple[KernelPlan, PlanProgram]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, plan: KernelPlan) -> PlanProgram:
        with self._lock:
            cached = self._programs.get(id(plan))
            if cached is not None:
                self._programs.move_to_end(id(plan))
                return cached[1]
        durations = launch_durations(plan, self.device_name)
        known = durations if all(d is not None for d in durations) else None
        program = PlanProgram.of(plan, known)  # type: ignore[arg-type]
        with self._lock:
            self._programs[id(plan)] = (plan, program)
            while len(self._programs) > self.limit:
                self._programs.popitem(last=False)
        return program

    def __len__(self) -> int:
        return len(self._programs)
