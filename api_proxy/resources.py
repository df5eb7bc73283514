"""What the proxy's requests hold on the device, and the waits an op may need before it acts.

`Resources` is the device side the forwarded ops work on: the runtime, `ProxyMemory` (pool, executor,
shared weights), the IO daemon, the communication store, the table of nameable buffers (`BufferTable`:
who holds what), the loaded plans and the helper pools for slow work. It checks every handle a function
names (`tensor`), registers and frees buffers (request-scoped), and ends an invocation.

Slow work never runs on the dispatcher: the helpers `plan_for`, `weights` and `uploads_issued` are
generators that *yield* an `Offload` (a future run on a helper thread) when they must wait, so the op
that calls them (`yield from`) is suspended there and resumed where it stopped (`calls.Calls`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import torch

from streambox.comm.errors import GetTimeout
from streambox.comm.lease import span_bytes
from streambox.comm.store_protocol import Store
from streambox.device import Event, Runtime, Stream
from streambox.device.base import contiguous_strides
from streambox.io_daemon import CopyRequest, IODaemon
from streambox.kernel_compiler.model_pool import ModelPool, PlanKey
from streambox.kernel_compiler.plan import KernelPlan
from streambox.phases import COMM, MODEL_LOAD

from .batched_infer import Batching
from .buffers import BufferTable
from .device_tensor import DeviceTensor
from .errors import IsolationError, QuotaExceeded, UnknownHandle, UnknownModel
from .function_spec import ProxyFunction
from .handles import DTYPES, Handle
from .isolated_lowering import lower_in_child
from .issuer import Issuer
from .partition import cu_cap_for
from .proxy_memory import ProxyMemory
from .state import Instance, Invocation
from .waits import Offload, Wait

#: Plans (batch, input shape) a proxy holds or lowers per model: each new shape costs seconds of CPU
#: and a plan in the shared model pool, so a function cannot make it lower without end.
MAX_PLANS_PER_MODEL = 64


def torch_dtype(name: Any) -> torch.dtype:
    if name not in DTYPES:
        raise TypeError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return getattr(torch, name)


class _Held:
    """One user of a model's weights, let go on exit (`with (yield from res.weights(plan)):`)."""

    def __init__(self, resources: Resources | None, model: str = "") -> None:
        self._resources, self._model = resources, model

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        if self._resources is not None:
            self._resources.memory.models.release(self._model)


class Resources:
    def __init__(
        self,
        workflow: str,
        runtime: Runtime,
        memory: ProxyMemory,
        io: IODaemon,
        store: Store,  # CommStore (managed) or IpcStore (CUDA-IPC style)
        model_pool: ModelPool,
        *,
        model_shapes: str,
        post: Callable[[Callable[[], None]], None],
        issuer: Issuer | None = None,
        invocation_bytes: int = 4 << 30,
    ) -> None:
        self.workflow, self.runtime, self.memory, self.io, self.store = workflow, runtime, memory, io, store
        self.model_pool = model_pool
        self.model_shapes = model_shapes
        self.compute_units = runtime.properties().compute_units  # what a function's gpu_percent caps
        self._post = post  # runs a function on the dispatcher (from any thread)
        self.issuer = issuer  # issues plans off the dispatcher (None: on it)
        self.buffers = BufferTable()
        self.invocation_bytes = invocation_bytes  # device bytes one invocation's own buffers may hold
        self.batching = Batching()  # infers of concurrent invocations gathered into batches
        self.service = runtime.create_stream()  # frees of buffers that outlive their holders
        self.plans: dict[PlanKey, KernelPlan] = {}
        self.lowerings: dict[PlanKey, Future[KernelPlan]] = {}
        self.failed_lowerings: dict[PlanKey, str] = {}  # deterministic: not lowered again
        # A registered model named without its version ("tiny"), resolved once: the proxy serves that
        # version for its life (a later `models add tiny` made batch 4 run tiny@2 beside batch 1's tiny@1).
        self.pinned: dict[str, str] = {}
        # Work the dispatcher must not wait for: plans read or lowered, weights issued by the daemon.
        self._lower_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="streambox-lower")
        self._wait_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="streambox-issue")
        self.closing = False

    def close(self) -> None:
        self.closing = True  # waits for the daemon give up; a lowering in progress finishes unheard
        if self.issuer is not None:
            self.issuer.close()
        self._wait_pool.shutdown(wait=True, cancel_futures=True)
        self._lower_pool.shutdown(wait=False, cancel_futures=True)

    def cu_cap(self, spec: ProxyFunction) -> int | None:
        """The compute-unit cap of `spec`'s kernels: its `gpu_percent` of this device (None: all)."""
        return cu_cap_for(spec.gpu_percent, self.compute_units)

    def record(self, stream: Stream) -> Event:
        event = self.runtime.create_event(timing=False)
        event.record(stream)
        return event

    # -- plans and weights ---------------------------------------------------------------------
    def pin(self, model: str) -> str:
        """`model` as this proxy serves it: a zoo name or `name@version` as given, a registered name
        without a version as the version it named at its first use (`pinned`)."""
        if model in self.pinned or "@" in model:
            return self.pinned.get(model, model)
        resolved = self.model_pool.entry(model).name  # zoo: the name; registered: its latest `name@version`
        return self.pinned.setdefault(model, resolved)

    def plan_key(self, model: str, batch: int, shape: tuple[int, ...] | None = None) -> PlanKey:
        """(model as pinned, batch, input shape without the batch; None: the configured default shape)."""
        model = self.pin(model)
        if shape is None:
            entry = self.model_pool.entry(model)  # zoo or registered; UnknownModelError names both
            small = entry.small_input_shape if self.model_shapes == "small" else None
            shape = tuple(small or entry.input_shape)
        return model, batch, tuple(shape)

    def load(self, model: str, batch: int, shape: tuple[int, ...] | None = None) -> KernelPlan:
        """The plan of `plan_key(model, batch, shape)`, its weights resident. A plan the model pool
        lacks is lowered here, once (blocking: for start-up, after `lower_missing` lowered a deploy's
        plans on several cores; at serve time `plan_for` reads or lowers plans on a helper thread)."""
        key = self.plan_key(model, batch, shape)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.model_pool.get_or_lower(*key)
            weights = self.memory.models.acquire(plan, self.service)
            del weights
            self.memory.models.release(plan.model, after=self.record(self.service))
            self.plans[key] = plan
        return plan

    def function_plan(self, spec: ProxyFunction, model: str) -> KernelPlan:
        if model not in spec.models:
            raise UnknownModel(
                f"function {spec.name!r} declared models {list(spec.models)}; {model!r} is not among them"
            )
        return self.load(model, spec.batch_size)

    def plan_for(self, model: str, batch: int, shape: tuple[int, ...]) -> Generator[Wait, Any, KernelPlan]:
        """The plan of (model, batch, shape): the proxy's, else read from the model pool or lowered on
        a helper thread (once however many calls want it) while the caller waits."""
        model = self.pin(model)
        key = (model, batch, shape)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        if key in self.failed_lowerings:
            raise ValueError(self.failed_lowerings[key])
        future = self.lowerings.get(key)
        if future is None:
            groups = (self.plans, self.lowerings, self.failed_lowerings)
            held = sum(k[0] == model for group in groups for k in group)
            if held >= MAX_PLANS_PER_MODEL:
                raise ValueError(
                    f"model {model!r} has plans for {held} (batch, input shape) pairs in this proxy, "
                    f"the limit (MAX_PLANS_PER_MODEL); batch {batch}, shape {list(shape)} would be "
                    "another: resize the inputs to a shape already used"
                )
            # A registered model's lowering runs its author's code: in a process of its own, not this one.
            lower = self.model_pool.get_or_lower
            if "@" in model:  # pinned: a registered model
                lower = partial(lower_in_child, self.model_pool.root)
            future = self._lower_pool.submit(lower, model, batch, shape)
            self.lowerings[key] = future
            future.add_done_callback(lambda f: self._post(lambda: self._lowered(key, f)))
        shape_text = "x".join(map(str, shape))
        what = f"lowering {model} for batch {batch}, input shape {shape_text}"
        plan = yield Offload(future, what, MODEL_LOAD)
        return self.plans.setdefault(key, plan)

    def _lowered(self, key: PlanKey, future: Future[KernelPlan]) -> None:
        if self.lowerings.get(key) is future:
            del self.lowerings[key]
        error = future.exception()
        if error is None:
            self.plans.setdefault(key, future.result())
        elif not isinstance(error, OSError) and not getattr(error, "transient", False):  # it would again
            model, batch, shape = key
            why = f"{type(error).__name__}: {str(error)[:2000]}"
            where = f"{model!r} for batch {batch}, shape {list(shape)}"
            self.failed_lowerings[key] = f"cannot lower {where}; {why}"

    def weights(self, plan: KernelPlan) -> Generator[Wait, Any, _Held]:
        """Wait (off the dispatcher) until the weights of `plan` are resident and issued by the daemon;
        the caller then holds one user of them until it leaves the returned context."""
        models = self.memory.models
        if not models.would_block(plan):
            return _Held(None)
        future = self._wait_pool.submit(models.hold_issued, plan, lambda: self.closing)
        try:
            yield Offload(future, f"loading the weights of {plan.model}", MODEL_LOAD)
        except GeneratorExit:  # the call was dropped (its instance died) after the hold was taken
            if future.done() and future.exception() is None:
                models.release(plan.model)
            raise
        return _Held(self, plan.model)

    # -- uploads ---------------------------------------------------------------------------------
    def after_uploads_issued(self, inst: Instance, then: Callable[[], None]) -> None:
        """An instance's uploads no call has waited for (its handler returned without using them):
        once the daemon has issued them, its stream waits for them and `then()` runs on the dispatcher
        (at once, or posted). So the buffers they fill are freed after the copies, not while the
        daemon still writes into them."""
        pending = [t for t in inst.gates if not t.issued and t.error is None]
        if not pending:
            self._gates_to_stream(inst)
            then()
            return

        def issued(_: Any) -> None:
            def go() -> None:
                self._gates_to_stream(inst)
                then()

            self._post(go)

        self._wait_pool.submit(self._wait_issued, pending).add_done_callback(issued)

    @staticmethod
    def _gates_to_stream(inst: Instance) -> None:
        gates, inst.gates = inst.gates, []
        for ticket in gates:
            with contextlib.suppress(Exception):  # a failed upload: the call that used it saw the error
                ticket.wait_all(inst.stream, timeout=0.0)

    def _wait_issued(self, tickets: list[Any]) -> None:
        """On a helper thread: until the daemon has issued every block of `tickets` (or failed them:
        the call that goes on meets the error)."""
        for ticket in tickets:
            while not self.closing:
                try:
                    ticket.last_event(timeout=0.2)
                except TimeoutError:
                    continue
                except Exception:  # noqa: BLE001 - the ticket's error, raised where the call uses it
                    pass
                break

    def uploads_issued(self, inst: Instance) -> Generator[Wait, Any, None]:
        """Wait until the daemon has issued the instance's uploads, then make the stream wait for them."""
        pending = [t for t in inst.gates if not t.issued and t.error is None]
        if pending:
            yield Offload(self._wait_pool.submit(self._wait_issued, pending), "uploading the inputs", COMM)
        gates, inst.gates = inst.gates, []
        for ticket in gates:
            ticket.wait_all(inst.stream)

    # -- buffers ---------------------------------------------------------------------------------
    def handle(self, t: DeviceTensor) -> Handle:
        dtype = str(t.dtype).removeprefix("torch.")
        return Handle(self.workflow, t.address, dtype, tuple(t.shape), tuple(t.strides), t.nbytes)

    def alloc(
        self,
        inst: Instance,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        *,
        quota: bool = True,
        stream: Stream | None = None,
    ) -> DeviceTensor:
        """Device memory for work on `stream` (default: `inst`'s), within its invocation's quota
        (`quota=False`: the proxy's own buffers that the invocation will not hold, e.g. a batch's
        gathered inputs)."""
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        if quota and inst.invocation is not None:
            self.check_quota(inst.spec.name, inst.invocation, nbytes)
        address = self.memory.allocator.allocate(max(nbytes, 1), stream or inst.stream)
        return DeviceTensor(address, dtype, shape, contiguous_strides(shape), nbytes)

    def check_quota(self, function: str, inv: Invocation, nbytes: int) -> None:
        """Raise `QuotaExceeded` unless `inv` may hold `nbytes` more device bytes of its own."""
        held = self.buffers.made_by(inv.holder)
        if held + nbytes > self.invocation_bytes:
            raise QuotaExceeded(
                f"{function}: {nbytes} more bytes would hold {held + nbytes} device bytes in this "
                f"invocation's buffers; at most {self.invocation_bytes} (invocation_device_bytes; free "
                "or put what it no longer needs)"
            )

    def upload(self, inst: Instance, inv: Invocation, payload: Any) -> DeviceTensor:
        dtype_name, shape, data = payload
        dtype = torch_dtype(dtype_name)
        shape = tuple(int(d) for d in shape)
        # For the stream the daemon copies on: not a block the instance's queued kernels still use.
        t = self.alloc(inst, dtype, shape, stream=self.io.copy_stream(inst.key, inst.stream))
        if len(data) != t.nbytes:
            self.memory.pool.free(t.address, inst.stream)
            raise ValueError(f"tensor of {dtype_name}{list(shape)} needs {t.nbytes} bytes, got {len(data)}")
        if t.nbytes:
            host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            # stream: where stream-only mode issues the copy (the daemon's own ring and stream otherwise)
            inst.gates.append(
                self.io.submit(inst.key, [CopyRequest(t.address, host, t.nbytes)], stream=inst.stream)
            )
        self.register(t, inv)
        return t

    def tensor(self, inv: Invocation, obj: Any) -> DeviceTensor:
        """The live buffer a function's handle names (held by `inv` from now on), or a clear refusal."""
        h = Handle.from_wire(obj)
        if h.workflow != self.workflow:
            raise IsolationError(
                f"handle {h.address:#x} belongs to workflow {h.workflow!r}; the proxy of workflow "
                f"{self.workflow!r} refuses it"
            )
        buf = self.buffers.get(h.address)
        if buf is None:
            raise UnknownHandle(
                f"handle {h.address:#x} names no live buffer of workflow {self.workflow!r} "
                f"(freed, or never allocated here)"
            )
        if inv.holder not in buf.holders:  # another invocation's buffer: only its holders may name it
            raise IsolationError(
                f"handle {h.address:#x} names a buffer this invocation neither made nor was handed "
                f"(request {inv.request_id!r}); pass data between invocations by key (put/get)"
            )
        span = span_bytes(h.shape, h.strides, DTYPES[h.dtype])
        if span > buf.nbytes or h.nbytes > buf.nbytes or min(h.strides, default=0) < 0:
            raise UnknownHandle(
                f"handle {h.address:#x} claims {max(span, h.nbytes)} bytes; the buffer has {buf.nbytes}"
            )
        self.buffers.hold(h.address, inv.holder)
        return DeviceTensor(h.address, torch_dtype(h.dtype), h.shape, h.strides, h.nbytes)

    def register(self, t: DeviceTensor, inv: Invocation) -> Handle:
        self.buffers.add(t.address, t.nbytes, t, inv.holder)
        return self.handle(t)

    def release(self, address: int, holder: Any, event: Event | None, *, fence: bool = True) -> bool:
        """`holder` lets go of a buffer; the last one frees it (on the service stream, after the
        events its holders left). True if freed."""
        buf = self.buffers.release(address, holder, event)
        if buf is None or buf.external:
            return False
        stream = self.service
        for e in buf.events:
            stream.wait_event(e)
        self.memory.pool.free(address, stream)
        if fence:
            self.memory.pool.fence(stream)
        return True

    def take(self, inst: Instance, inv: Invocation, key: str, device: int) -> Handle | None:
        """One GET served now (the caller's stream waits for the producer), or None if not there yet."""
        try:
            h = self.store.get(key, device=device, timeout=0.0, owner=inst.key)
        except GetTimeout:
            return None
        h.wait(inst.stream)
        inv.leases.append(h)
        t = DeviceTensor(h.address, h.dtype, tuple(h.shape), tuple(h.strides), h.nbytes)
        buf = self.buffers.get(h.address)
        if buf is not None and buf.external:
            self.buffers.hold(h.address, inv.holder)
        else:
            self.buffers.add(h.address, h.nbytes, t, inv.holder, external=True)
        return self.handle(t)

    def end_invocation(
        self, inv: Invocation, inst: Instance, event: Event | None, *, free_buffers: bool = True
    ) -> None:
        """The request is over: free the buffers it made (not PUT) and hand back the store's leases,
        both after the work issued on the instance's stream so far. `free_buffers=False`: a copy may
        still write into them (a dead instance's upload that would not settle): they are kept."""
        if event is None:
            event = self.record(inst.stream)
        if free_buffers:
            held = self.buffers.held_by(inv.holder)
            freed = [self.release(a, inv.holder, event, fence=False) for a in held]
            if any(freed):
                self.memory.pool.fence(self.service)
        for lease in inv.leases:
            with contextlib.suppress(Exception):
                lease.release(inst.stream)
        inv.leases.clear()
